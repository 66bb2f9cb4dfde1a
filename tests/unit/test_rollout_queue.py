"""The rollout queue over a real SQLite file: bounds, exact batches, staleness, acks, restarts."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from slurm_elastic.rollouts.queue import QueueConfig, QueueFull, RolloutQueue, UnknownBatchError
from slurm_elastic.rollouts.store import RolloutStore


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def payload(group_id: str, n: int = 4, version: int = 0) -> bytes:
    return json.dumps({"id": group_id, "group_size": n, "policy_version": version,
                       "sequences": [{"tokens": [1, 2, 3], "score": 1.0}] * n}).encode()


def make(tmp: Path, **cfg: object) -> RolloutQueue:
    config = QueueConfig(**{"batch_size": 8, "capacity_seqs": 16, "max_staleness": 1, **cfg})  # type: ignore[arg-type]
    return RolloutQueue(RolloutStore(tmp / "q.sqlite"), config, clock=Clock())


def submit(q: RolloutQueue, group_id: str, n: int = 4, version: int = 0) -> bool:
    return q.submit(group_id, "0001", n, version, payload(group_id, n, version))


def test_bounded_with_backpressure_and_nothing_lost(tmp_path: Path) -> None:
    q = make(tmp_path)
    for i in range(4):
        assert submit(q, f"g{i}")
    with pytest.raises(QueueFull) as full:
        submit(q, "g4")
    assert full.value.retry_after_s > 0 and q.stats()["refused_submits"] == 1
    q.pull()
    assert submit(q, "g4")  # room again: the refused group goes in on retry
    assert q.stats()["queued_sequences"] == 12


def test_batches_are_exactly_batch_size_of_whole_groups(tmp_path: Path) -> None:
    q = make(tmp_path, capacity_seqs=100)
    submit(q, "a", 4)
    submit(q, "b", 6)
    submit(q, "c", 4)
    batch = q.pull()
    assert batch is not None
    ids = [json.loads(p)["id"] for p in batch[1]]
    assert ids == ["a", "c"]  # b (6) does not fit beside a (4): the look-ahead takes c
    assert q.pull() is None  # only b (6 < 8) is left
    assert q.stats()["queued_sequences"] == 6


def test_payloads_round_trip_byte_for_byte(tmp_path: Path) -> None:
    q = make(tmp_path)
    q.submit("x", "0001", 8, 0, payload("x", 8))
    batch = q.pull()
    assert batch is not None and batch[1] == [payload("x", 8)]


def test_duplicates_are_not_stored_twice(tmp_path: Path) -> None:
    q = make(tmp_path)
    assert submit(q, "g") and not submit(q, "g")
    batch = q.pull() if submit(q, "h") else None
    assert batch is not None
    q.ack(batch[0])
    assert not submit(q, "g")  # even after delivery


def test_a_resend_of_a_delivered_group_is_a_retry_even_with_the_buffer_full(tmp_path: Path) -> None:
    """The SDK resends a group whose answer it lost; a full buffer must not turn that into 429s
    (the worker would retry until room frees for a group stored long ago)."""
    q = make(tmp_path)
    assert submit(q, "g") and submit(q, "h")
    batch = q.pull()
    assert batch is not None
    q.ack(batch[0])
    for i in range(4):
        assert submit(q, f"f{i}")
    with pytest.raises(QueueFull):
        submit(q, "new")
    assert not submit(q, "g")
    assert q.stats()["refused_submits"] == 1


def submit_at(q: RolloutQueue, group_id: str, version: int, n: int = 4) -> bool:
    """A group made while the trainer was at ``version`` (a resume moves it there, back or forth)."""
    q.set_version(version, recovered=True)
    return submit(q, group_id, n, version)


def test_stale_groups_are_dropped_and_counted(tmp_path: Path) -> None:
    q = make(tmp_path, capacity_seqs=100)
    submit(q, "old", 4, version=0)
    q.set_version(1)
    q.set_version(2)
    submit(q, "new1", 4, version=2)
    submit(q, "new2", 4, version=2)
    batch = q.pull()
    assert batch is not None and [json.loads(p)["id"] for p in batch[1]] == ["new1", "new2"]
    assert q.stats()["dropped_stale_sequences"] == 4


@pytest.mark.parametrize(("groups", "version", "handed", "dropped_seqs", "left_seqs"), [
    # (id, version) in arrival order, the trainer's version, the batch handed out, sequences dropped, left
    ([("a", 2), ("old", 0), ("b", 2)], 2, ["a", "b"], 4, 0),  # a stale group behind a fresh one
    ([("a", 2), ("b", 2), ("old", 0)], 2, ["a", "b"], 4, 0),  # behind the whole batch: dropped all the same
    ([("o1", 0), ("a", 3), ("o2", 1), ("b", 3), ("c", 3)], 3, ["a", "b"], 8, 4),  # several, between fresh ones
    ([("a", 1), ("b", 2), ("c", 1)], 2, ["a", "b"], 0, 4),  # version - max_staleness is still fresh
    ([("o1", 0), ("a", 2), ("o2", 0)], 2, None, 8, 4),  # not enough fresh left: no batch, stale ones still go
])
def test_every_stale_group_is_dropped_wherever_it_sits(
        tmp_path: Path, groups: list[tuple[str, int]], version: int, handed: list[str] | None,
        dropped_seqs: int, left_seqs: int) -> None:
    q = make(tmp_path, capacity_seqs=100)  # max_staleness 1
    for group_id, group_version in groups:
        submit_at(q, group_id, group_version)
    q.set_version(version, recovered=True)
    batch = q.pull()
    assert (None if batch is None else [json.loads(p)["id"] for p in batch[1]]) == handed
    stats = q.stats()
    assert (stats["dropped_stale_sequences"], stats["queued_sequences"]) == (dropped_seqs, left_seqs)
    assert stats["queued_groups"] == left_seqs // 4


def test_a_group_dropped_behind_the_head_is_never_handed_out_later(tmp_path: Path) -> None:
    q = make(tmp_path, capacity_seqs=100)
    for group_id in ["a", "b", "c"]:
        submit(q, group_id, 4, version=0)
    q.set_version(1)
    for group_id in ["d", "e"]:
        submit(q, group_id, 4, version=1)
    first = q.pull()
    assert first is not None and [json.loads(p)["id"] for p in first[1]] == ["a", "b"]
    q.set_version(2)  # c (version 0) is now too old; d and e (version 1) are fine
    second = q.pull()
    assert second is not None and [json.loads(p)["id"] for p in second[1]] == ["d", "e"]
    assert q.stats()["dropped_stale_sequences"] == 4 and q.stats()["queued_sequences"] == 0
    submit(q, "f", 4, version=2)
    submit(q, "g", 4, version=2)
    third = q.pull()
    assert third is not None and [json.loads(p)["id"] for p in third[1]] == ["f", "g"]


def test_rates_count_what_arrived_after_observing_began(tmp_path: Path) -> None:
    q = make(tmp_path, capacity_seqs=1000, batch_size=4)
    clock: Clock = q.clock  # type: ignore[assignment]
    for i in range(7):  # a batch of 4 every 10 s: 0.4 seq/s
        submit(q, f"g{i}", 4)
        assert q.pull() is not None
        clock.t += 10.0
    clock.t -= 5.0
    stats = q.stats()  # 65 s after the first pull: the last 60 s hold six of them
    assert stats["consumption_seqs_per_s"] == pytest.approx(0.4)
    # production's window is 120 s: a series younger than it counts what came after its first event
    assert stats["production_seqs_per_s"] == pytest.approx(6 * 4 / 65.0)


def test_ack_is_idempotent_and_unknown_batches_are_errors(tmp_path: Path) -> None:
    q = make(tmp_path)
    submit(q, "a")
    submit(q, "b")
    batch_id, _ = q.pull()  # type: ignore[misc]
    assert q.ack(batch_id) is True and q.ack(batch_id) is False
    assert q.stats()["delivered_sequences"] == 8
    with pytest.raises(UnknownBatchError):
        q.ack("0" * 32)


def test_restart_keeps_the_queue_and_hands_unacked_batches_out_again(tmp_path: Path) -> None:
    q = make(tmp_path, capacity_seqs=100)
    for i in range(5):
        submit(q, f"g{i}")
    first = q.pull()
    assert first is not None
    q.store.close()
    again = make(tmp_path, capacity_seqs=100)  # a new controller on the same state directory
    assert again.stats()["queued_sequences"] == 12 and again.stats()["unacked_batches"] == 1
    rehanded = again.pull()
    assert rehanded == first  # same id, same content
    again.ack(rehanded[0])
    nxt = again.pull()
    assert nxt is not None and [json.loads(p)["id"] for p in nxt[1]] == ["g2", "g3"]


def test_trainer_restart_gets_unacked_batches_first(tmp_path: Path) -> None:
    q = make(tmp_path, capacity_seqs=100)
    for i in range(4):
        submit(q, f"g{i}")
    first = q.pull()
    assert q.trainer_restarted()[1] == 1
    assert q.pull() == first


def test_used_admissions_do_not_expire(tmp_path: Path) -> None:
    q = make(tmp_path, max_staleness=0, max_concurrent=1000, admission_ttl_s=60)
    q.admit(8, "0001")
    submit(q, "a", 4)
    submit(q, "b", 4)
    q.clock.t += 61  # type: ignore[attr-defined]
    assert q.admit(8, "0001") == 0  # both submitted: accepted, still inside the window until consumed


def test_version_survives_restart_and_recovery_is_bounded(tmp_path: Path) -> None:
    q = make(tmp_path, max_staleness=2, max_concurrent=1000)
    q.set_version(50, recovered=True)
    assert q.stats()["staleness_capacity"] == 3 * 8
    q.store.close()
    again = make(tmp_path, max_staleness=2, max_concurrent=1000)
    assert again.stats()["policy_version"] == 50 and again.stats()["staleness_capacity"] == 3 * 8


def test_admission_gate(tmp_path: Path) -> None:
    q = make(tmp_path, max_staleness=0, max_concurrent=1000)
    assert q.admit(5, "0001") == 5 and q.admit(5, "0001") == 3 and q.admit(1, "0001") == 0  # one window of 8
    submit(q, "a", 4)
    assert q.stats()["running_rollouts"] == 4


def test_dropped_stale_groups_free_their_staleness_capacity(tmp_path: Path) -> None:
    q = make(tmp_path, capacity_seqs=100, max_staleness=0, max_concurrent=1000)
    assert q.admit(8, "0001") == 8
    submit(q, "a", 4, version=0)
    submit(q, "b", 4, version=0)
    assert q.stats()["staleness_capacity"] == 0
    q.set_version(1)  # the trainer moved on without consuming a and b
    assert q.pull() is None and q.stats()["dropped_stale_sequences"] == 8
    assert q.stats()["staleness_capacity"] == 16  # (0 + 1 + 1) * 8 - 0: the dropped ones do not count


def test_unused_admissions_expire(tmp_path: Path) -> None:
    q = make(tmp_path, max_staleness=0, max_concurrent=1000, admission_ttl_s=60)
    assert q.admit(8, "0001") == 8 and q.admit(1, "0001") == 0
    q.clock.t += 61  # type: ignore[attr-defined]  # the worker died without submitting
    assert q.admit(8, "0001") == 8


def test_the_queue_is_in_use_once_a_trainer_or_rollouts_show_up(tmp_path: Path) -> None:
    q = make(tmp_path)
    assert not q.in_use
    q.pull()
    assert q.in_use
    q.store.close()
    assert not make(tmp_path).in_use  # an empty store after a restart: still unused
    other = make(tmp_path / "x" if (tmp_path / "x").mkdir() is None else tmp_path)
    submit(other, "a")
    other.store.close()
    assert RolloutQueue(RolloutStore(tmp_path / "x" / "q.sqlite"), other.config).in_use


def test_group_commit_concurrent_submits_are_all_durable_and_answered_once(tmp_path: Path) -> None:
    q = make(tmp_path, capacity_seqs=10_000)
    ids = [f"c{i}" for i in range(200)] + ["c7", "c42"]  # two resends race their originals
    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(lambda g: submit(q, g), ids))
    assert answers.count(True) == 200 and answers.count(False) == 2  # each group accepted exactly once
    commits_before = q.store.commits
    assert q.store._syncer is not None
    os.kill(q.store._syncer.pid, signal.SIGSTOP)  # the disk hangs: these 50 pile up, none answered yet
    try:
        futures = [q.submit_later(f"f{i}", "0001", 4, 0, payload(f"f{i}")) for i in range(50)]
        time.sleep(0.2)
        assert not any(f.done() for f in futures)
    finally:
        os.kill(q.store._syncer.pid, signal.SIGCONT)
    assert all(f.result() is True for f in futures)
    assert q.store.commits - commits_before <= 2  # they shared transactions (and fsyncs)
    q.store.close()  # everything acknowledged is on disk: a new controller finds it all
    again = make(tmp_path, capacity_seqs=10_000)
    assert again.stats()["queued_groups"] == 250 and again.stats()["queued_sequences"] == 1000
    stored = {json.loads(p)["id"] for _ in range(125) for p in (again.pull() or ("", []))[1]}
    assert stored == {*ids, *(f"f{i}" for i in range(50))}


def test_submits_waiting_for_their_commit_count_against_the_bound(tmp_path: Path) -> None:
    q = make(tmp_path)  # 16 sequences
    waiting = [q.submit_later(f"w{i}", "0001", 4, 0, payload(f"w{i}")) for i in range(4)]
    with pytest.raises(QueueFull):
        q.submit_later("over", "0001", 4, 0, payload("over"))
    assert all(f.result() for f in waiting) and q.stats()["queued_sequences"] == 16


def test_the_snapshot_is_none_until_the_queue_is_in_use_then_carries_its_numbers(tmp_path: Path) -> None:
    q = make(tmp_path, capacity_seqs=100)
    assert q.snapshot() is None
    submit(q, "a", 4)
    assert q.admit(3, "0002") == 3
    snap = q.snapshot()
    stats = q.stats()
    assert snap is not None
    assert (snap.queued_seqs, snap.batch_size, snap.in_flight_seqs, snap.buffer_capacity_seqs) == (
        stats["queued_sequences"], 8, 3, 100)
    assert (snap.max_staleness, snap.staleness_capacity_seqs) == (1, stats["staleness_capacity"])
    assert snap.production_seqs_per_s == stats["production_seqs_per_s"]
    q.store.close()


def test_the_trainers_step_time_and_waits_are_measured_from_its_pulls(tmp_path: Path) -> None:
    q = make(tmp_path, capacity_seqs=1000, batch_size=4)
    clock: Clock = q.clock  # type: ignore[assignment]
    assert q.pull() is None  # the trainer asks: nothing yet, it waits
    assert q.snapshot() is not None and q.snapshot().trainer_waiting is True  # type: ignore[union-attr]
    clock.t += 6.0
    submit(q, "a", 4)
    batch = q.pull()  # served after 6 s of waiting
    assert batch is not None and q.snapshot().trainer_waiting is False  # type: ignore[union-attr]
    clock.t += 8.0  # computes 8 s, acknowledges, then asks again
    assert q.ack(batch[0])
    submit(q, "b", 4)
    assert q.pull() is not None
    snapshot, stats = q.snapshot(), q.stats()
    assert snapshot is not None and snapshot.trainer_step_s == pytest.approx(8.0)
    assert stats["trainer_step_s"] == pytest.approx(8.0) and stats["trainer_wait_fraction"] == pytest.approx(6 / 14)


def test_a_publish_whose_save_fails_changes_nothing(tmp_path: Path) -> None:
    from slurm_elastic.rollouts.storage import StoreUnavailableError

    q = make(tmp_path, capacity_seqs=100, max_staleness=0)
    submit(q, "a")  # version 0
    saved = q.store.save_staleness

    def full_disk(snapshot: object) -> None:
        raise StoreUnavailableError("disk full", 1.0)

    q.store.save_staleness = full_disk  # type: ignore[method-assign]
    before = (q.stats()["policy_version"], q.stats()["staleness_capacity"])
    for recovered in (False, True):
        with pytest.raises(StoreUnavailableError):
            q.set_version(1, recovered=recovered)
        assert (q.stats()["policy_version"], q.stats()["staleness_capacity"]) == before == (0, 4)
    assert submit(q, "b")  # version 0 is not stale: the refused publish never happened
    assert q.pull() is not None and q.stats()["dropped_stale_sequences"] == 0
    q.store.save_staleness = saved  # type: ignore[method-assign]
    q.set_version(1)
    assert q.stats()["policy_version"] == 1


def test_two_acks_at_once_count_the_batch_once_whichever_finishes_first(tmp_path: Path) -> None:
    """A retried ack racing its original: the store says True to one, False to the other. The one
    told False may finish first; the batch's sequences are still counted delivered, once."""
    q = make(tmp_path)
    submit(q, "a")
    submit(q, "b")
    pulled = q.pull()
    assert pulled is not None
    batch_id = pulled[0]
    store_ack = q.store.ack
    winner_stored, loser_done = threading.Event(), threading.Event()

    def ack_in_order(bid: str) -> bool | None:
        result = store_ack(bid)
        if result:  # the winner waits until the loser has done all it does
            winner_stored.set()
            loser_done.wait(10)
        return result

    q.store.ack = ack_in_order  # type: ignore[method-assign]
    winner = threading.Thread(target=q.ack, args=(batch_id,))
    winner.start()
    assert winner_stored.wait(10)
    assert q.ack(batch_id) is False
    loser_done.set()
    winner.join(10)
    assert q.stats()["delivered_sequences"] == 8
