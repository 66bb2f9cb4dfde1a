"""A damaged payload log, on the real store on disk: a flipped byte, a truncated or deleted
segment, a lost index. Damaged groups are quarantined (recorded as lost, counted, reported),
never handed out; a lost index with a log beside it is refused."""

from __future__ import annotations

import json
import os
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore


def body(group_id: str, size: int = 200) -> bytes:
    return json.dumps({"id": group_id, "group_size": 4, "pad": "x" * size}).encode()


def ids(payloads: list[bytes]) -> list[str]:
    return [json.loads(p)["id"] for p in payloads]  # every payload handed out is the JSON sent


def where(tmp: Path, group_id: str) -> tuple[Path, int, int]:
    """The segment file holding ``group_id``'s body, the body's offset and size."""
    with sqlite3.connect(tmp / "q.sqlite") as db:
        segment, offset, nbytes = db.execute("SELECT segment, body_offset, nbytes FROM groups WHERE id=?",
                                             (group_id,)).fetchone()
    return tmp / "q.segments" / f"{segment:08d}.log", offset, nbytes


def flip_byte(tmp: Path, group_id: str, at: int = 10) -> None:
    path, offset, _n = where(tmp, group_id)
    data = bytearray(path.read_bytes())
    data[offset + at] ^= 0x01  # e.g. a digit of a token id: still valid JSON, wrong content
    path.write_bytes(bytes(data))


def filled(tmp: Path, names: list[str], segment_bytes: int = 64 * 1024 * 1024) -> RolloutStore:
    store = RolloutStore(tmp / "q.sqlite", segment_bytes=segment_bytes)
    for name in names:
        assert store.insert(name, "0007", 4, 0, body(name)) is not None
    return store


def queue_over(tmp: Path, names: list[str]) -> RolloutQueue:
    store = filled(tmp, names)
    return RolloutQueue(store, QueueConfig(batch_size=8, capacity_seqs=100))


def test_a_flipped_byte_is_never_handed_out_and_the_group_is_recorded_lost(tmp_path: Path) -> None:
    store = filled(tmp_path, ["a", "b", "c"])
    flip_byte(tmp_path, "b")
    payloads = store.hand_out("b1", ["a", "b", "c"], 1.0)
    assert ids(payloads) == ["a", "c"]
    (lost,) = store.lost()
    assert (lost.id, lost.worker_id, lost.version, lost.n_seqs) == ("b", "0007", 0, 4)
    assert "checksum" in lost.reason
    assert store.counts().get("lost") == 4
    store.close()
    again = RolloutStore(tmp_path / "q.sqlite")  # recorded durably
    assert [g.id for g in again.lost()] == ["b"] and [g for g, _ in again.batch_payloads("b1")] == ["a", "c"]
    again.close()


def test_a_pull_skips_a_damaged_group_keeps_batches_exact_and_reports_it(tmp_path: Path) -> None:
    q = queue_over(tmp_path, ["a", "b", "c", "d"])
    flip_byte(tmp_path, "b")
    batch = q.pull()
    assert batch is not None and ids(batch[1]) == ["a", "c"]  # exactly batch_size, without b
    assert q.lost_ids_for(batch[0]) == ["b"] and q.lost_ids_for("another-batch") == []
    stats = q.stats()
    assert (stats["lost_groups"], stats["lost_sequences"], stats["queued_sequences"]) == (1, 4, 4)
    assert q.ack(batch[0]) and q.stats()["delivered_sequences"] == 8
    assert q.pull() is None  # d alone is not a batch; b is gone for good
    q.store.close()


def test_a_rehanded_batch_with_a_damaged_group_keeps_its_id_without_the_group(tmp_path: Path) -> None:
    q = queue_over(tmp_path, ["a", "b"])
    first = q.pull()
    assert first is not None and q.trainer_restarted()[1] == 1
    flip_byte(tmp_path, "b", at=3)
    again = q.pull()
    assert again is not None and again[0] == first[0] and ids(again[1]) == ["a"]
    assert q.lost_ids_for(again[0]) == ["b"]
    assert q.ack(first[0]) and q.stats()["delivered_sequences"] == 4  # b was never delivered
    assert q.stats()["lost_sequences"] == 4
    q.store.close()


def test_damage_found_at_open_is_quarantined_before_anything_is_handed_out(tmp_path: Path) -> None:
    filled(tmp_path, ["a", "b", "c"]).close()
    flip_byte(tmp_path, "c", at=0)
    q = RolloutQueue(RolloutStore(tmp_path / "q.sqlite"), QueueConfig(batch_size=8, capacity_seqs=100))
    assert [g.id for g in q.store.queued()] == ["a", "b"] and q.stats()["queued_sequences"] == 8
    assert "checksum" in q.store.lost()[0].reason
    batch = q.pull()
    assert batch is not None and ids(batch[1]) == ["a", "b"] and q.lost_ids_for(batch[0]) == ["c"]
    q.store.close()


def test_damage_found_at_open_in_an_older_segment_loses_only_the_damaged_group(tmp_path: Path) -> None:
    """The segment is no longer the one appended to (a restart rolled over): its other groups
    stay readable, not deleted with it."""
    filled(tmp_path, ["a", "b", "c"]).close()
    RolloutStore(tmp_path / "q.sqlite").close()  # a restart: appends go to a new segment
    flip_byte(tmp_path, "b", at=0)
    q = RolloutQueue(RolloutStore(tmp_path / "q.sqlite"), QueueConfig(batch_size=8, capacity_seqs=100))
    assert where(tmp_path, "a")[0].exists()
    batch = q.pull()
    assert batch is not None and ids(batch[1]) == ["a", "c"] and q.stats()["lost_groups"] == 1
    assert q.lost_ids_for(batch[0]) == ["b"]
    q.store.close()


def test_a_truncated_segment_loses_only_what_was_cut_and_new_groups_stay_readable(tmp_path: Path) -> None:
    filled(tmp_path, [f"g{i}" for i in range(6)]).close()
    path, offset, _n = where(tmp_path, "g3")
    with open(path, "r+b") as f:
        f.truncate(offset + 5)  # g3 cut in its body; g4, g5 gone
    store = RolloutStore(tmp_path / "q.sqlite")
    assert [g.id for g in store.queued()] == ["g0", "g1", "g2"]
    assert sorted(g.id for g in store.lost()) == ["g3", "g4", "g5"]
    for name in ["n0", "n1"]:
        assert store.insert(name, "0007", 4, 0, body(name)) is not None
    store.close()
    again = RolloutStore(tmp_path / "q.sqlite")  # the new groups were not written where the old ones were
    assert ids(again.hand_out("b", [g.id for g in again.queued()], 1.0)) == ["g0", "g1", "g2", "n0", "n1"]
    again.close()


def test_a_missing_segment_is_refused_and_its_groups_given_up_only_when_it_is_made_empty(tmp_path: Path) -> None:
    """Before, a missing segment's groups were quarantined at open, for good: also a whole log
    directory on a file system not mounted yet (a differential audit)."""
    store = filled(tmp_path, [f"g{i}" for i in range(12)], segment_bytes=1024)
    assert len(store.log.numbers()) >= 3
    store.close()
    first, _o, _n = where(tmp_path, "g0")
    gone = {g for g in [f"g{i}" for i in range(12)] if where(tmp_path, g)[0] == first}
    first.rename(tmp_path / "aside")
    with pytest.raises(StateFileError, match=rf"holds {len(gone)} undelivered group\(s\) whose records are gone: 1 "
                                             rf"segment\(s\) .* are missing \({first.name}\).* touch {re.escape(str(first))}"):
        RolloutStore(tmp_path / "q.sqlite", segment_bytes=1024)
    log_dir = first.parent
    log_dir.rename(tmp_path / "unmounted")
    with pytest.raises(StateFileError, match=rf"its payload log {re.escape(str(log_dir))} is missing"):
        RolloutStore(tmp_path / "q.sqlite", segment_bytes=1024)
    (tmp_path / "unmounted").rename(log_dir)
    first.touch()  # given up, as the message says
    again = RolloutStore(tmp_path / "q.sqlite", segment_bytes=1024)
    assert {g.id for g in again.lost()} == gone and not first.exists()  # empty: nothing kept to look at
    left = [g.id for g in again.queued()]
    assert ids(again.hand_out("b", left, 1.0)) == [f"g{i}" for i in range(12) if f"g{i}" not in gone]
    again.close()


def test_a_segment_put_back_loses_nothing(tmp_path: Path) -> None:
    store = filled(tmp_path, [f"g{i}" for i in range(12)], segment_bytes=1024)
    store.close()
    first, _o, _n = where(tmp_path, "g0")
    first.rename(tmp_path / "aside")
    with pytest.raises(StateFileError):
        RolloutStore(tmp_path / "q.sqlite", segment_bytes=1024)
    (tmp_path / "aside").rename(first)
    again = RolloutStore(tmp_path / "q.sqlite", segment_bytes=1024)
    assert again.lost() == [] and ids(again.hand_out("b", [g.id for g in again.queued()], 1.0)) == [
        f"g{i}" for i in range(12)]
    again.close()


@pytest.mark.parametrize("replace", [os.mkdir, os.mkfifo])
def test_a_segment_that_is_not_a_regular_file_is_refused_naming_it(tmp_path: Path,
                                                                   replace: Callable[[Path], None]) -> None:
    """A FIFO in a segment's place made the store's open wait forever, with nothing logged (found
    by a crash audit); a directory was named as the index's problem."""
    store = filled(tmp_path, [f"g{i}" for i in range(12)], segment_bytes=1024)
    store.close()
    first, _o, _n = where(tmp_path, "g0")
    first.unlink()
    replace(first)
    with pytest.raises(StateFileError, match=rf"segment {re.escape(str(first))} is not a regular file"):
        RolloutStore(tmp_path / "q.sqlite", segment_bytes=1024)


def test_a_lost_index_beside_a_log_is_refused_with_what_to_do(tmp_path: Path) -> None:
    store = filled(tmp_path, ["a", "b"])
    store.hand_out("b1", ["a", "b"], 1.0)
    assert store.ack("b1")
    store.close()
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"q.sqlite{suffix}").unlink(missing_ok=True)
    with pytest.raises(StateFileError, match=r"q\.sqlite is missing.*move .*q\.segments aside"):
        RolloutStore(tmp_path / "q.sqlite")
    (tmp_path / "q.sqlite").write_bytes(b"")  # an empty index is no better
    with pytest.raises(StateFileError, match="holds no index"):
        RolloutStore(tmp_path / "q.sqlite")
    (tmp_path / "q.segments").rename(tmp_path / "q.segments.old")  # what the message says to do
    fresh = RolloutStore(tmp_path / "q.sqlite")
    assert fresh.queued() == [] and fresh.insert("c", "0007", 4, 0, body("c")) is not None
    fresh.close()


def test_groups_stored_after_a_lost_segment_are_found_again_if_their_index_rows_are_lost(tmp_path: Path) -> None:
    filled(tmp_path, ["a", "b", "c"]).close()
    (segment,) = (tmp_path / "q.segments").glob("*.log")
    segment.unlink()  # the segment being appended to, gone ...
    with pytest.raises(StateFileError, match="3 undelivered group"):
        RolloutStore(tmp_path / "q.sqlite")
    segment.touch()  # ... and given up
    store = RolloutStore(tmp_path / "q.sqlite")
    assert sorted(g.id for g in store.lost()) == ["a", "b", "c"]
    for name in ["n0", "n1"]:
        assert store.insert(name, "0007", 4, 0, body(name)) is not None
    store.close()
    with sqlite3.connect(tmp_path / "q.sqlite") as db:  # a power cut took their index rows
        db.execute("DELETE FROM groups WHERE id IN ('n0', 'n1')")
    again = RolloutStore(tmp_path / "q.sqlite")
    assert [g.id for g in again.queued()] == ["n0", "n1"]  # found in the log past the lost ones
    assert ids(again.hand_out("b", ["n0", "n1"], 1.0)) == ["n0", "n1"]
    again.close()


@pytest.mark.parametrize(("what", "edit", "says"), [
    ("a state no version writes", "UPDATE groups SET state='bogus' WHERE id='b'", "state 'bogus'"),
    ("a sequence count as text", "UPDATE groups SET n_seqs='x' WHERE id='b'", "n_seqs 'x'"),
    ("a negative sequence count", "UPDATE groups SET n_seqs=-5 WHERE id='b'", "n_seqs -5"),
    ("a negative version", "UPDATE groups SET version=-1 WHERE id='b'", "version -1"),
    ("a handed group in no open batch", "UPDATE groups SET state='handed', batch_id='nowhere' WHERE id='b'",
     "batch 'nowhere'"),
])
def test_index_rows_this_version_never_writes_are_refused_naming_the_row(tmp_path: Path, what: str, edit: str,
                                                                         says: str) -> None:
    """Such rows were skipped unreported (a group in an unknown state was neither queued nor
    lost) or stopped the controller with a TypeError; the store is left as it was."""
    filled(tmp_path, ["a", "b", "c"]).close()
    with sqlite3.connect(tmp_path / "q.sqlite") as db:
        db.execute(edit)
    with pytest.raises(StateFileError, match=rf"q\.sqlite is damaged: 1 group row\(s\) .*id 'b'.*{says}.*aside"):
        RolloutStore(tmp_path / "q.sqlite")
    with sqlite3.connect(tmp_path / "q.sqlite") as db:
        assert [r[0] for r in db.execute("SELECT id FROM groups ORDER BY seq")] == ["a", "b", "c"], what


@pytest.mark.parametrize("damage", ["DELETE FROM meta", "DROP TABLE meta", "DELETE FROM meta WHERE key = 'staleness'"])
def test_a_lost_meta_table_is_refused_not_read_as_version_0(tmp_path: Path, damage: str) -> None:
    """The policy version and the staleness counts live in ``meta``: with its rows gone the queue
    started again at version 0 (staleness capacity 0) over groups of version 2, unreported."""
    store = RolloutStore(tmp_path / "q.sqlite")
    queue = RolloutQueue(store, QueueConfig(batch_size=8, capacity_seqs=100, max_staleness=2))
    queue.set_version(1)
    queue.set_version(2)
    for name in ["a", "b"]:
        assert store.insert(name, "0007", 4, 2, body(name)) is not None
    store.close()
    with sqlite3.connect(tmp_path / "q.sqlite") as db:
        db.execute(damage)
    with pytest.raises(StateFileError, match=r"q\.sqlite is damaged: its meta table.* 2 group\(s\) of policy "
                                             r"versions up to 2: the version would start again at 0.*aside"):
        RolloutStore(tmp_path / "q.sqlite")
    with sqlite3.connect(tmp_path / "q.sqlite") as db:
        assert [r[0] for r in db.execute("SELECT id FROM groups ORDER BY seq")] == ["a", "b"]


def test_a_store_of_version_0_groups_without_meta_rows_still_opens(tmp_path: Path) -> None:
    """Nothing was published yet (or the index predates the marker row): version 0 is the truth."""
    filled_at_0 = RolloutStore(tmp_path / "q.sqlite")
    assert filled_at_0.insert("a", "0007", 4, 0, body("a")) is not None
    filled_at_0.close()
    with sqlite3.connect(tmp_path / "q.sqlite") as db:
        db.execute("DELETE FROM meta")
    again = RolloutQueue(RolloutStore(tmp_path / "q.sqlite"), QueueConfig(batch_size=8, capacity_seqs=100))
    assert again.stats()["queued_sequences"] == 4 and again.stats()["policy_version"] == 0
    again.store.close()


@pytest.mark.parametrize("saved", [
    {"version": -7, "gross_seqs": 0, "at_seq": 0, "leases": {}},
    {"version": 1, "gross_seqs": -100, "at_seq": 0, "leases": {}},
    {"version": 1, "gross_seqs": 0, "at_seq": 0, "leases": {"0001": [-50, 1000.0]}},
], ids=["version", "accepted", "lease"])
def test_staleness_counts_no_queue_saves_are_refused_not_served(tmp_path: Path, saved: dict[str, object]) -> None:
    """Negative counts would open as a version below 0 or a capacity above the bound (damage
    SQLite does not see): refused like any index row this version never writes."""
    queue = RolloutQueue(RolloutStore(tmp_path / "q.sqlite"), QueueConfig(batch_size=8, capacity_seqs=100))
    queue.set_version(1)
    queue.store.close()
    with sqlite3.connect(tmp_path / "q.sqlite") as db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'staleness'", (json.dumps(saved),))
    with pytest.raises(StateFileError, match=r"unreadable staleness snapshot.*negative"):
        RolloutQueue(RolloutStore(tmp_path / "q.sqlite"), QueueConfig(batch_size=8, capacity_seqs=100))


@pytest.mark.parametrize("damage", ["DELETE FROM lost", "DROP TABLE lost"])
def test_lost_groups_whose_record_of_why_is_gone_are_still_reported(tmp_path: Path, damage: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Before, a dropped or emptied ``lost`` table made quarantined groups vanish from the report."""
    store = filled(tmp_path, ["a", "b", "c"])
    flip_byte(tmp_path, "b")
    assert ids(store.hand_out("b1", ["a", "b", "c"], 1.0)) == ["a", "c"]
    store.close()
    with sqlite3.connect(tmp_path / "q.sqlite") as db:
        db.execute(damage)
    again = RolloutStore(tmp_path / "q.sqlite", clock=lambda: 500.0)
    (lost,) = again.lost()
    assert (lost.id, lost.worker_id, lost.n_seqs, lost.lost_s) == ("b", "0007", 4, 500.0)
    assert "lost with the index's lost table" in lost.reason
    assert "1 lost group(s) had no record of why" in caplog.text
    assert [g for g, _ in again.batch_payloads("b1")] == ["a", "c"]  # nothing else changed
    again.close()
    reopened = RolloutStore(tmp_path / "q.sqlite", clock=lambda: 900.0)
    assert [(g.id, g.lost_s) for g in reopened.lost()] == [("b", 500.0)]  # recorded once, kept
    reopened.close()


def reopen(tmp: Path) -> RolloutQueue:
    return RolloutQueue(RolloutStore(tmp / "q.sqlite"), QueueConfig(batch_size=8, capacity_seqs=100))


def test_a_lost_group_is_named_until_a_batch_naming_it_is_acknowledged_whatever_the_restarts(tmp_path: Path) -> None:
    filled(tmp_path, ["a", "b", "c", "d", "e"]).close()
    flip_byte(tmp_path, "a", at=0)  # damaged while the controller was down
    reopen(tmp_path).store.close()  # quarantined at this open; the controller dies before any pull
    q = reopen(tmp_path)
    first = q.pull()
    assert first is not None and q.lost_ids_for(first[0]) == ["a"]  # still named after the second restart
    q.store.close()  # that answer is lost, and the controller dies again
    q = reopen(tmp_path)
    again = q.pull()
    assert again is not None and again[0] == first[0] and q.lost_ids_for(again[0]) == ["a"]  # handed out again
    assert q.ack(again[0])
    q.store.close()
    q = reopen(tmp_path)
    flip_byte(tmp_path, "e", at=3)
    for name in ("f", "g", "h"):
        q.submit(name, "0007", 4, 0, body(name))
    later = q.pull()
    assert later is not None and q.lost_ids_for(later[0]) == ["e"]  # "a" is told for good; the new loss is named
    q.store.close()


@pytest.mark.parametrize("name", ["q.sqlite", "q.sqlite-wal", "q.sqlite-shm", "q.segments"])
def test_a_store_file_of_the_wrong_kind_is_named(tmp_path: Path, name: str) -> None:
    """Before, SQLite's "disk I/O error" or "attempt to write a readonly database" named the index
    for a -wal or -shm directory, and a log directory that was a file read "[Errno 17] File exists"."""
    filled(tmp_path, ["a"]).close()
    odd = tmp_path / name
    if odd.is_dir():
        for child in odd.iterdir():
            child.unlink()
        odd.rmdir()
        odd.write_text("")
    else:
        odd.unlink(missing_ok=True)
        odd.mkdir()
    kind = "a directory" if name == "q.segments" else "a regular file"
    with pytest.raises(StateFileError, match=rf"{re.escape(str(odd))} is not {kind}"):
        RolloutStore(tmp_path / "q.sqlite")
