"""The rollout store's payload log and syncer, on real files and a real syncer process:
group commits, segment roll-over and clean-up, recovery after lost index rows or a torn tail,
a syncer that dies, a store in a format before the payload log refused."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts import commits
from slurm_elastic.rollouts.segments import (
    BLOCK_BYTES,
    HEADER,
    StagingBuffer,
    block_end,
    encode_record,
    group_head,
    json_str,
    scan,
    seal_records,
)
from slurm_elastic.rollouts.store import RolloutStore


def body(group_id: str, size: int = 100) -> bytes:
    return json.dumps({"id": group_id, "pad": "x" * size}).encode()


def insert(store: RolloutStore, group_id: str, size: int = 100) -> int | None:
    return store.insert(group_id, "0001", 4, 0, body(group_id, size))


def hand_out_all(store: RolloutStore, batch_id: str) -> list[bytes]:
    ids = [g.id for g in store.queued()]
    return store.hand_out(batch_id, ids, 1.0) if ids else []


def wait_for(predicate: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_records_round_trip_and_a_torn_tail_ends_the_scan(tmp_path: Path) -> None:
    path = tmp_path / "00000001.log"
    records = [encode_record({"seq": i, "id": f"g{i}"}, body(f"g{i}")) for i in range(3)]
    path.write_bytes(b"".join(records) + records[0][: len(records[0]) // 2])
    found, end = scan(path)
    assert [r.head["id"] for r in found] == ["g0", "g1", "g2"]
    assert end == sum(map(len, records))
    first = found[0]
    assert path.read_bytes()[first.body_offset:first.body_offset + first.body_bytes] == body("g0")
    flipped = bytearray(path.read_bytes())
    flipped[found[1].body_offset + 3] ^= 0xFF  # a damaged body fails its checksum
    path.write_bytes(bytes(flipped))
    assert [r.head["id"] for r in scan(path)[0]] == ["g0"]
    assert HEADER.size == 16


@given(st.integers(0, 2**62), st.text(max_size=20), st.text(max_size=20), st.integers(0, 4096), st.integers(0, 2**40))
def test_a_group_head_is_the_json_of_its_fields(seq: int, group_id: str, worker_id: str, n_seqs: int,
                                                version: int) -> None:
    head = group_head(seq, json_str(group_id), json_str(worker_id), n_seqs, version)
    assert head == json.dumps({"seq": seq, "id": group_id, "worker_id": worker_id, "n_seqs": n_seqs,
                               "version": version}, separators=(",", ":")).encode()


def test_concurrent_submits_share_commits_while_the_disk_is_slow(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "q.sqlite")
    assert insert(store, "first") == 1
    assert store._syncer is not None
    os.kill(store._syncer.pid, signal.SIGSTOP)  # the disk hangs: nothing can be durable
    try:
        futures = [store.insert_later(f"f{i}", "0001", 4, 0, body(f"f{i}")) for i in range(50)]
        time.sleep(0.3)
        assert not any(f.done() for f in futures)  # nobody is answered before the commit is durable
        commits_before = store.commits
    finally:
        os.kill(store._syncer.pid, signal.SIGCONT)
    assert sorted(f.result(timeout=10) or 0 for f in futures) == list(range(2, 52))
    assert store.commits - commits_before <= 2  # the 50 shared one or two fsyncs
    store.close()
    assert len(RolloutStore(tmp_path / "q.sqlite").queued()) == 51


def test_a_retried_id_is_stored_once_in_one_commit_or_across_commits(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "q.sqlite")
    assert insert(store, "a") is not None
    assert insert(store, "a") is None
    twins = [store.insert_later("b", "0001", 4, 0, body("b")) for _ in range(2)]
    assert sorted(f.result(timeout=10) is None for f in twins) == [False, True]
    assert [g.id for g in store.queued()] == ["a", "b"]
    store.close()


def test_submits_from_an_event_loop_are_committed_on_that_loop(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "q.sqlite")

    async def submit_all() -> list[int | None]:
        futures = [store.insert_later(f"e{i}", "0001", 4, 0, body(f"e{i}")) for i in range(20)]
        assert store._loop is asyncio.get_running_loop() and store._private_loop is None
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    assert sorted(asyncio.run(submit_all())) == list(range(1, 21))
    assert store.commits <= 2  # all 20 went in while one loop turn ran: one commit (or two)
    assert insert(store, "after") == 21  # that loop is closed: the store moves on to its own
    store.close()


def test_segments_roll_over_and_go_once_delivered(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "q.sqlite", segment_bytes=4096)
    for i in range(30):
        insert(store, f"s{i}", size=1000)
    segments = store.log.numbers()
    assert len(segments) >= 7
    payloads = hand_out_all(store, "b1")
    assert [json.loads(p)["id"] for p in payloads] == [f"s{i}" for i in range(30)]
    assert store.log.numbers() == segments  # handed out, not yet acknowledged: still needed
    assert store.ack("b1") is True
    assert store.log.numbers() == [segments[-1]]  # only the one being appended to is left
    insert(store, "late", size=1000)
    store.drop(["late"])
    store.close()
    reopened = RolloutStore(tmp_path / "q.sqlite", segment_bytes=4096)
    assert reopened.log.numbers() == [reopened.log.current] and reopened.counts()["delivered"] == 120
    reopened.close()


def filled_with_index_rows_lost(tmp: Path, prefix: str, groups: int, segment_bytes: int, lost: str) -> int:
    """A closed store of ``groups`` 1 kB groups whose index rows matching ``lost`` (SQL) are gone,
    as after a power cut; the newest segment's number."""
    store = RolloutStore(tmp / "q.sqlite", segment_bytes=segment_bytes)
    for i in range(groups):
        insert(store, f"{prefix}{i}", size=1000)
    newest = store.log.current
    store.close()
    with sqlite3.connect(tmp / "q.sqlite") as db:
        db.execute(f"DELETE FROM groups WHERE {lost}")
    return newest


def test_index_rows_lost_with_a_power_cut_are_found_again_in_the_log(tmp_path: Path) -> None:
    segment = filled_with_index_rows_lost(tmp_path, "p", 12, 4096, "seq > 5")
    with open(tmp_path / "q.segments" / f"{segment:08d}.log", "ab") as f:
        f.write(encode_record({"seq": 99, "id": "torn"}, body("torn"))[:40])  # a commit cut short
    again = RolloutStore(tmp_path / "q.sqlite", segment_bytes=4096)
    assert [g.id for g in again.queued()] == [f"p{i}" for i in range(12)]
    assert [json.loads(p)["id"] for p in hand_out_all(again, "b")] == [f"p{i}" for i in range(12)]
    assert insert(again, "next") == 13  # numbering goes on after what the log held
    again.close()


def test_recovery_reads_across_segments_that_end_in_block_padding(tmp_path: Path) -> None:
    filled_with_index_rows_lost(tmp_path, "p", 12, 4096, "1")  # every row: recovery reads every segment
    *older, _newest = sorted((tmp_path / "q.segments").glob("*.log"))
    assert older
    for path in older:  # as direct writes leave them (padded already where the filesystem took them)
        with open(path, "ab") as f:
            f.write(bytes(block_end(path.stat().st_size) - path.stat().st_size))
        assert path.stat().st_size % BLOCK_BYTES == 0
    again = RolloutStore(tmp_path / "q.sqlite", segment_bytes=4096)
    assert [g.id for g in again.queued()] == [f"p{i}" for i in range(12)]
    again.close()


@pytest.mark.parametrize(("fsync", "direct_io"), [("always", False), ("os", True)])
def test_the_log_goes_through_the_page_cache_when_told_or_not_fsynced(tmp_path: Path, fsync: str,
                                                                     direct_io: bool) -> None:
    store = RolloutStore(tmp_path / "q.sqlite", fsync=fsync, direct_io=direct_io)
    insert(store, "a", size=100)
    insert(store, "b", size=100)
    store.close()
    (segment,) = (tmp_path / "q.segments").glob("*.log")
    records, end = scan(segment)
    assert [r.head["id"] for r in records] == ["a", "b"] and segment.stat().st_size == end  # no padding


def test_damage_in_an_older_segment_is_a_clear_error(tmp_path: Path) -> None:
    filled_with_index_rows_lost(tmp_path, "d", 6, 2048, "1")  # recovery has to read every segment
    first = tmp_path / "q.segments" / "00000001.log"
    first.write_bytes(first.read_bytes()[:-5])
    with pytest.raises(StateFileError, match=r"00000001\.log is damaged"):
        RolloutStore(tmp_path / "q.sqlite", segment_bytes=2048)


def test_a_dead_syncer_fails_only_its_commit_and_is_started_again(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "q.sqlite")
    insert(store, "before")
    assert store._syncer is not None
    os.kill(store._syncer.pid, signal.SIGSTOP)
    pending = store.insert_later("lost", "0001", 4, 0, body("lost"))
    wait_for(lambda: store._in_flight is not None)
    os.kill(store._syncer.pid, signal.SIGKILL)
    with pytest.raises(StateFileError, match="commit failed"):
        pending.result(timeout=10)
    assert insert(store, "after") is not None  # a new syncer
    assert insert(store, "lost") is not None  # the worker's retry is stored
    store.close()
    again = RolloutStore(tmp_path / "q.sqlite")
    assert [g.id for g in again.queued()] == ["before", "after", "lost"]
    assert [json.loads(p)["id"] for p in hand_out_all(again, "b")] == ["before", "after", "lost"]
    again.close()


def test_a_syncer_that_died_between_commits_costs_no_commit(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "q.sqlite")
    insert(store, "before")
    assert store._syncer is not None
    store._syncer.kill()
    store._syncer.wait()
    assert insert(store, "after") is not None  # sent again, to a new syncer
    store.close()
    again = RolloutStore(tmp_path / "q.sqlite")
    assert [json.loads(p)["id"] for p in hand_out_all(again, "b")] == ["before", "after"]
    again.close()


@pytest.mark.parametrize("lead", [0, 1000])
def test_staged_records_once_sealed_are_the_records_encoded_whole(lead: int) -> None:
    staging = StagingBuffer(64)  # grows to fit
    heads = [b'{"seq":%d}' % i for i in range(3)]
    bodies = [body(f"g{i}", 50 * i) for i in range(3)]
    nbytes, body_at = staging.stage(heads, bodies, lead)
    assert staging.map is not None and len(staging.map) >= block_end(lead + nbytes)  # room for the padding
    seal_records(staging.map, lead, lead + nbytes)
    encoded = b"".join(encode_record(json.loads(h), b) for h, b in zip(heads, bodies, strict=True))
    assert staging.map[lead:lead + nbytes] == encoded
    assert [staging.map[lead + at:lead + at + len(b)] for at, b in zip(body_at, bodies, strict=True)] == bodies
    staging.close()


def test_a_group_bigger_than_a_commit_goes_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commits, "COMMIT_BYTES", 4096)
    store = RolloutStore(tmp_path / "q.sqlite")
    assert store._syncer is None
    insert(store, "small")
    futures = [store.insert_later(f"g{i}", "0001", 4, 0, body(f"g{i}", size)) for i, size in
               enumerate([100, 20_000, 100, 100, 3000, 3000])]
    assert [f.result(timeout=10) for f in futures] == list(range(2, 8))
    assert [json.loads(p)["id"] for p in hand_out_all(store, "b")] == ["small", *(f"g{i}" for i in range(6))]
    assert store._staging is not None and store._staging.nbytes >= 20_000
    store.close()


@pytest.mark.parametrize("columns", ["", ", segment INTEGER, body_offset INTEGER"])
def test_a_store_that_keeps_bodies_in_its_index_is_refused_and_left_as_it_was(tmp_path: Path, columns: str) -> None:
    with sqlite3.connect(tmp_path / "q.sqlite") as db:
        db.executescript(f"""
            CREATE TABLE groups (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL,
                worker_id TEXT NOT NULL, n_seqs INTEGER NOT NULL, version INTEGER NOT NULL,
                nbytes INTEGER NOT NULL, payload BLOB NOT NULL, state TEXT NOT NULL DEFAULT 'queued',
                batch_id TEXT{columns});""")
        db.execute("INSERT INTO groups (id, worker_id, n_seqs, version, nbytes, payload) VALUES (?,?,?,?,?,?)",
                   ("old", "0001", 4, 0, len(body("old")), body("old")))
    with pytest.raises(StateFileError, match="keeps group bodies inside its index"):
        RolloutStore(tmp_path / "q.sqlite")
    with sqlite3.connect(tmp_path / "q.sqlite") as db:
        assert db.execute("SELECT id, payload FROM groups").fetchall() == [("old", body("old"))]
        assert [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")] == [
            "groups", "sqlite_sequence"]
