"""An index older than its log, on the real store on disk: its ``-wal`` file deleted after a
kill -9, or an older copy of it restored. Refused at open (it would hand out again groups
delivered since), with what to do; a kill -9 alone, or a power cut's lagging mark, is no alarm;
a damaged mark is refused, a missing one checks nothing."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.mark import mark_path, read_mark, write_mark
from slurm_elastic.rollouts.store import RolloutStore


def body(group_id: str) -> bytes:
    return json.dumps({"id": group_id, "group_size": 4}).encode()


def delivered_then_killed(tmp: Path) -> None:
    """In a child process: a and b handed out and acknowledged, c queued; then kill -9 of it and
    its syncer (no close, so SQLite's WAL still holds the transactions)."""
    script = textwrap.dedent(f"""
        import json, os, signal
        from pathlib import Path
        from slurm_elastic.rollouts.store import RolloutStore
        RolloutStore(Path({str(tmp / "q.sqlite")!r})).close()  # the tables, in the index file itself
        store = RolloutStore(Path({str(tmp / "q.sqlite")!r}))
        for name in ["a", "b", "c"]:
            store.insert(name, "0007", 4, 0, json.dumps({{"id": name}}).encode())
        store.hand_out("b1", ["a", "b"], 1.0)
        assert store.ack("b1")
        os.killpg(0, signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], check=False, start_new_session=True)
    assert done.returncode == -9


def test_a_kill_9_alone_opens_with_nothing_handed_out_again(tmp_path: Path) -> None:
    delivered_then_killed(tmp_path)
    assert (tmp_path / "q.sqlite-wal").exists()
    store = RolloutStore(tmp_path / "q.sqlite")
    assert [g.id for g in store.queued()] == ["c"] and store.counts()["delivered"] == 8
    store.close()


def test_an_index_whose_wal_was_deleted_after_a_kill_9_is_refused(tmp_path: Path) -> None:
    delivered_then_killed(tmp_path)
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"q.sqlite{suffix}").unlink()
    with pytest.raises(StateFileError, match=r"q\.sqlite is older than its log: it has committed 0 .* q\.mark "
                                             r"says 2 .*Restore the newest q\.sqlite with its -wal file"):
        RolloutStore(tmp_path / "q.sqlite")
    mark_path(tmp_path / "q.sqlite").unlink()  # what the message offers: hand them out again, knowingly
    store = RolloutStore(tmp_path / "q.sqlite")
    assert [g.id for g in store.queued()] == ["a", "b", "c"]  # the log's records, indexed again as queued
    store.close()


def test_an_index_whose_wal_held_only_submits_and_version_publishes_is_refused(tmp_path: Path) -> None:
    """Found by a crash audit: with the publishes of versions 8 to 10 lost with the -wal file, the
    store opened at version 7 and handed a trainer at version 10 groups of version 7 (bound 2)."""
    script = textwrap.dedent(f"""
        import json, os, signal
        from pathlib import Path
        from slurm_elastic.core.staleness_snapshot import StalenessSnapshot
        from slurm_elastic.rollouts.store import RolloutStore
        store = RolloutStore(Path({str(tmp_path / "q.sqlite")!r}))
        store.save_staleness(StalenessSnapshot(7, 0, 0, {{}}))
        store.close()  # version 7 in the index file itself
        store = RolloutStore(Path({str(tmp_path / "q.sqlite")!r}))
        store.save_staleness(StalenessSnapshot(7, 0, 0, {{}}))  # the same version: no transition
        for name in ["a", "b"]:
            store.insert(name, "0007", 4, 7, json.dumps({{"id": name}}).encode())
        for version in (8, 9, 10):
            store.save_staleness(StalenessSnapshot(version, 8, 2, {{}}))
        os.killpg(0, signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], check=False, start_new_session=True)
    assert done.returncode == -9
    assert read_mark(tmp_path / "q.sqlite") == 4  # version 7's first save, then 8, 9 and 10
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"q.sqlite{suffix}").unlink()
    with pytest.raises(StateFileError, match=r"older than its log: it has committed 1 hand-outs, acknowledgements, "
                                             r"drops, quarantines and version publishes, its mark q\.mark says 4"):
        RolloutStore(tmp_path / "q.sqlite")


def test_an_older_copy_of_the_index_restored_is_refused_and_nothing_is_changed(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "q.sqlite")
    for name in ["a", "b", "c"]:
        store.insert(name, "0007", 4, 0, body(name))
    store.hand_out("b1", ["a"], 1.0)
    store.close()
    shutil.copy(tmp_path / "q.sqlite", tmp_path / "backup.sqlite")  # closed: the copy is whole
    store = RolloutStore(tmp_path / "q.sqlite")
    assert store.ack("b1")
    store.hand_out("b2", ["b"], 2.0)
    assert store.ack("b2")
    store.close()
    shutil.copy(tmp_path / "backup.sqlite", tmp_path / "q.sqlite")
    before = (tmp_path / "q.sqlite").read_bytes()
    with pytest.raises(StateFileError, match=r"committed 1 hand-outs.* says 4 .*an older copy was restored"):
        RolloutStore(tmp_path / "q.sqlite")
    assert (tmp_path / "q.sqlite").read_bytes() == before
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"q.sqlite{suffix}").unlink(missing_ok=True)
    shutil.move(tmp_path / "q.sqlite", tmp_path / "aside.sqlite")  # what the message offers: start empty
    shutil.move(tmp_path / "q.segments", tmp_path / "aside.segments")
    fresh = RolloutStore(tmp_path / "q.sqlite")
    assert fresh.queued() == [] and read_mark(tmp_path / "q.sqlite") == 0  # the mark starts again
    fresh.close()
    assert RolloutStore(tmp_path / "q.sqlite").queued() == []


def test_a_mark_behind_the_index_is_allowed_and_catches_up(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "q.sqlite")
    for name in ["a", "b"]:
        store.insert(name, "0007", 4, 0, body(name))
    store.hand_out("b1", ["a", "b"], 1.0)
    store.drop(["nothing"])
    store.close()
    assert read_mark(tmp_path / "q.sqlite") == 2
    write_mark(tmp_path / "q.sqlite", 1)  # a power cut: the mark is not fsynced, the index is
    store = RolloutStore(tmp_path / "q.sqlite")
    assert store.ack("b1")
    assert read_mark(tmp_path / "q.sqlite") == 3
    store.close()


@pytest.mark.parametrize("damage", [b"", b"junk\n", b"\xff\xfe", "directory",
                                    b"slurm-elastic rollout st0re transitions 00000000000000000004\n"])
def test_a_damaged_mark_is_refused_until_restored_or_deleted(tmp_path: Path, damage: bytes | str) -> None:
    """Marks are renamed into place whole, so one that is there and cannot be read is damage;
    before, it was only logged ("not checked this time") and an older index opened."""
    delivered_then_killed(tmp_path)
    (tmp_path / "q.sqlite-wal").unlink()  # refused on its own: the mark says 2, the index 0
    good = mark_path(tmp_path / "q.sqlite").read_bytes()
    mark_path(tmp_path / "q.sqlite").unlink()
    if isinstance(damage, bytes):
        mark_path(tmp_path / "q.sqlite").write_bytes(damage)
    else:
        mark_path(tmp_path / "q.sqlite").mkdir()
    with pytest.raises(StateFileError, match=r"mark .*q\.mark is damaged .*Restore q\.mark from a copy; or, to open "
                                             r"without that check knowingly .*delete .*q\.mark"):
        RolloutStore(tmp_path / "q.sqlite")
    if damage == "directory":
        os.rmdir(mark_path(tmp_path / "q.sqlite"))
    mark_path(tmp_path / "q.sqlite").write_bytes(good)  # restored: the older index is refused again
    with pytest.raises(StateFileError, match="older than its log"):
        RolloutStore(tmp_path / "q.sqlite")


def test_a_missing_mark_opens_unchecked(tmp_path: Path) -> None:
    """A store from before marks, or one whose mark was deleted knowingly: opens, and gets one."""
    store = RolloutStore(tmp_path / "q.sqlite")
    store.insert("a", "0007", 4, 0, body("a"))
    store.hand_out("b1", ["a"], 1.0)
    store.close()
    mark_path(tmp_path / "q.sqlite").unlink()
    store = RolloutStore(tmp_path / "q.sqlite")
    assert read_mark(tmp_path / "q.sqlite") is None
    assert store.ack("b1") and read_mark(tmp_path / "q.sqlite") == 2
    store.close()


def test_a_mark_that_cannot_be_written_changes_nothing_else(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    mark_path(tmp_path / "q.sqlite").mkdir()  # it cannot be opened for writing
    with caplog.at_level(logging.WARNING):
        store = RolloutStore(tmp_path / "q.sqlite")
        for name in ["a", "b"]:
            store.insert(name, "0007", 4, 0, body(name))
        assert len(store.hand_out("b1", ["a"], 1.0)) == 1
        assert store.ack("b1")
    assert caplog.text.count("writing its mark failed") == 1
    os.rmdir(mark_path(tmp_path / "q.sqlite"))
    assert len(store.hand_out("b2", ["b"], 2.0)) == 1
    assert read_mark(tmp_path / "q.sqlite") == 3
    store.close()
