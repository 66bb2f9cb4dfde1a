"""Batch packing: exact batches of whole groups, the oldest groups first, found whenever the
look-ahead holds one; a group that fits with nothing does not hold up the others."""

from __future__ import annotations

import itertools
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_elastic.rollouts.packing import oldest_exact_batch
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore


def make(tmp: Path, batch_size: int, lookahead_groups: int = 64) -> RolloutQueue:
    config = QueueConfig(batch_size=batch_size, capacity_seqs=10_000, lookahead_groups=lookahead_groups, fsync="off")
    return RolloutQueue(RolloutStore(tmp / "q.sqlite", fsync="off"), config, clock=lambda: 1000.0)


def fill(q: RolloutQueue, groups: list[tuple[str, int]], version: int = 0) -> None:
    for group_id, n in groups:
        assert q.submit(group_id, "0001", n, version, json.dumps({"id": group_id, "n": n}).encode())


def pulled_ids(q: RolloutQueue) -> list[str] | None:
    batch = q.pull()
    return None if batch is None else [json.loads(p)["id"] for p in batch[1]]


def oldest_by_brute_force(sizes: list[int], batch_size: int) -> list[int] | None:
    """Among every subset summing to batch_size, the one that takes the oldest groups: compare
    membership from the head (taking group 0 beats any set without it, and so on)."""
    best: tuple[int, ...] | None = None
    for members in itertools.product((1, 0), repeat=len(sizes)):  # 1 first: the first found is the best
        if sum(n for n, m in zip(sizes, members, strict=True) if m) == batch_size:
            best = members
            break
    return None if best is None else [i for i, m in enumerate(best) if m]


@pytest.mark.parametrize(("sizes", "batch_size", "expected"), [
    ([4, 3, 4, 4, 4, 4], 8, [0, 2]),  # the 3 fits with nothing: passed over
    ([1, 2, 4, 4], 4, [2]),  # 1 + 2 make 3, never 4: the first 4 is the batch
    ([1, 2, 4, 1], 4, [0, 1, 3]),  # ... until a 1 arrives: the oldest groups go first
    ([3, 4, 4, 5], 8, [0, 3]),  # 3 + 5 beats 4 + 4: it takes the head
    ([5, 4, 3, 4], 8, [0, 2]),  # the one pass from the head: 5 + 3
    ([6, 5, 3], 8, [1, 2]),  # greedy would take 6 and stop; 5 + 3 is the batch
    ([3, 3, 3], 8, None),
    ([], 8, None),
])
def test_the_oldest_exact_batch(sizes: list[int], batch_size: int, expected: list[int] | None) -> None:
    assert oldest_exact_batch(sizes, batch_size) == expected


def test_a_group_with_no_sequences_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one sequence"):
        oldest_exact_batch([4, 0, 4], 8)


@given(sizes=st.lists(st.integers(1, 9), max_size=11), batch_size=st.integers(1, 16))
@settings(max_examples=400, deadline=None)
def test_packing_matches_the_brute_force(sizes: list[int], batch_size: int) -> None:
    """Found whenever a subset sums to batch_size; exact; each group once; the oldest groups."""
    taken = oldest_exact_batch(sizes, batch_size)
    assert taken == oldest_by_brute_force(sizes, batch_size)
    if taken is not None:
        assert sum(sizes[i] for i in taken) == batch_size and taken == sorted(set(taken))


def test_a_group_that_fits_with_nothing_does_not_hold_up_the_others(tmp_path: Path) -> None:
    q = make(tmp_path, batch_size=8)  # the auditor's case: a worker filtered one sequence
    fill(q, [("a", 4), ("b", 3), ("c", 4), ("d", 4), ("e", 4), ("f", 4)])
    assert pulled_ids(q) == ["a", "c"] and pulled_ids(q) == ["d", "e"] and pulled_ids(q) is None
    fill(q, [("g", 5)])
    assert pulled_ids(q) == ["b", "g"]  # the 3 goes as soon as something completes it
    assert pulled_ids(q) is None and q.stats()["queued_sequences"] == 4


def test_small_groups_at_the_head_do_not_stall_a_long_queue(tmp_path: Path) -> None:
    q = make(tmp_path, batch_size=4)
    fill(q, [("a", 1), ("b", 2)] + [(f"f{i}", 4) for i in range(100)])
    assert [pulled_ids(q) for _ in range(3)] == [["f0"], ["f1"], ["f2"]]
    fill(q, [("c", 1)])  # 99th in line, past the window of 4 + 64 groups: reached as the 4s go
    got = [pulled_ids(q) for _ in range(98)]
    assert got[:32] == [[f"f{i}"] for i in range(3, 35)]
    assert got[32] == ["a", "b", "c"]  # in the window now: the oldest groups go first
    assert got[33:] == [[f"f{i}"] for i in range(35, 100)] and q.stats()["queued_sequences"] == 0


def test_the_window_is_batch_size_plus_the_lookahead_then_the_whole_queue(tmp_path: Path) -> None:
    q = make(tmp_path, batch_size=4, lookahead_groups=2)
    fill(q, [("a", 3), ("b", 3), ("c", 3), ("d", 3), ("e", 3), ("f", 3), ("g", 4), ("h", 1)])
    assert pulled_ids(q) == ["a", "h"]  # h is past 4 + 2 groups: the window holds none, the queue does
    assert pulled_ids(q) == ["g"]  # in the window now
    assert pulled_ids(q) is None  # nothing left that makes 4, searched once
    fill(q, [("i", 1)])
    assert pulled_ids(q) == ["b", "i"]


def test_groups_that_fit_with_nothing_cannot_block_the_queue(tmp_path: Path) -> None:
    """Twelve groups of 3 fill a window of 8 + 4 and make no batch of 8 among themselves; the
    4s behind them still make batches (before, every pull answered 204 for ever)."""
    q = make(tmp_path, batch_size=8, lookahead_groups=4)
    fill(q, [(f"three{i}", 3) for i in range(12)] + [(f"four{i}", 4) for i in range(20)])
    assert [pulled_ids(q) for _ in range(10)] == [[f"four{2 * i}", f"four{2 * i + 1}"] for i in range(10)]
    assert pulled_ids(q) is None and q.stats()["queued_sequences"] == 36


def test_groups_dropped_as_stale_inside_the_window_are_passed(tmp_path: Path) -> None:
    q = make(tmp_path, batch_size=8)  # max_staleness 4
    q.set_version(1, recovered=True)
    fill(q, [("a", 4)], version=1)
    q.set_version(0, recovered=True)  # a resume from an earlier checkpoint
    fill(q, [("old", 3)], version=0)
    q.set_version(5, recovered=True)  # "old" (version 0) is stale now, "a" (version 1) is not
    fill(q, [("b", 3), ("c", 5), ("d", 4)], version=5)
    assert pulled_ids(q) == ["a", "d"] and pulled_ids(q) == ["b", "c"]
    assert q.stats()["dropped_stale_sequences"] == 3 and q.stats()["queued_sequences"] == 0


@given(sizes=st.lists(st.integers(1, 8), min_size=1, max_size=14), batch_size=st.integers(1, 12),
       lookahead_groups=st.integers(1, 6))
@settings(max_examples=60, deadline=None)
def test_pulls_from_a_real_queue(sizes: list[int], batch_size: int, lookahead_groups: int) -> None:
    """Whenever some queued groups sum to batch_size a pull answers a batch: the oldest in the
    window of batch_size + lookahead_groups, else in the whole queue; every batch is exactly
    batch_size of whole groups; no group is handed out twice."""
    sizes = [min(n, batch_size) for n in sizes]  # a group over batch_size is refused at the door
    with tempfile.TemporaryDirectory() as tmp:
        q = make(Path(tmp), batch_size, lookahead_groups)
        fill(q, [(f"g{i}", n) for i, n in enumerate(sizes)])
        size_of = {f"g{i}": n for i, n in enumerate(sizes)}
        left = list(size_of)
        seen: set[str] = set()
        while True:
            fits = any(sum(size_of[g] for g in subset) == batch_size
                       for r in range(1, len(left) + 1) for subset in itertools.combinations(left, r))
            window = left[:batch_size + lookahead_groups]
            oldest = oldest_by_brute_force([size_of[g] for g in window], batch_size)
            if oldest is None:
                window = left
                oldest = oldest_by_brute_force([size_of[g] for g in window], batch_size)
            got = pulled_ids(q)
            assert got == (None if oldest is None else [window[i] for i in oldest])
            if got is None:
                assert not fits
                break
            assert sum(size_of[g] for g in got) == batch_size and len(set(got)) == len(got)
            assert not seen & set(got)
            seen |= set(got)
            left = [g for g in left if g not in got]
        assert q.stats()["queued_sequences"] == sum(size_of[g] for g in left)
        q.store.close()
