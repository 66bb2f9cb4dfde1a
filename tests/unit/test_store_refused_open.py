"""A refused open changes nothing: the index, its ``-wal`` and its ``-shm`` are left byte for byte
as they were, for the operator to restore or keep as the refusal says. Before, the refusing
process's read-write connection checkpointed the readable part of the ``-wal`` into the index and
deleted the ``-wal`` (and rebuilt the ``-shm``) when it closed."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.mark import mark_path
from slurm_elastic.rollouts.store import RolloutStore

FILES = ("q.sqlite", "q.sqlite-wal", "q.sqlite-shm", "q.mark")


def killed_with_a_live_wal(tmp: Path, edit: str = "") -> None:
    """In a child process: 40 groups, 20 batches handed out and acknowledged (the -wal holds them),
    ``edit`` run on the store's own connection, then kill -9 of it and its syncer."""
    script = textwrap.dedent(f"""
        import json, os, signal
        from pathlib import Path
        from slurm_elastic.rollouts.store import RolloutStore
        RolloutStore(Path({str(tmp / "q.sqlite")!r})).close()  # the tables, in the index file itself
        store = RolloutStore(Path({str(tmp / "q.sqlite")!r}))
        for i in range(40):
            store.insert(f"g{{i}}", "0007", 4, 0, json.dumps({{"id": i}}).encode())
        for i in range(0, 40, 2):
            store.hand_out(f"b{{i}}", [f"g{{i}}", f"g{{i + 1}}"], 1.0)
            assert store.ack(f"b{{i}}")
        if {edit!r}:
            store._index.db.execute({edit!r})
        os.killpg(0, signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], check=False, start_new_session=True)
    assert done.returncode == -9
    assert (tmp / "q.sqlite-wal").stat().st_size > 0 and (tmp / "q.sqlite-shm").exists()


def digests(tmp: Path) -> dict[str, str | None]:
    return {name: hashlib.sha256((tmp / name).read_bytes()).hexdigest() if (tmp / name).exists() else None
            for name in FILES}


def flip_middle_of_wal(tmp: Path) -> None:
    path = tmp / "q.sqlite-wal"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # a frame's checksum fails: SQLite reads the -wal up to it
    path.write_bytes(bytes(data))


def garble_mark(tmp: Path) -> None:
    path = mark_path(tmp / "q.sqlite")
    path.write_text(path.read_text().replace("rollout store", "rollout st0re"))


@pytest.mark.parametrize(("damage", "edit", "says"), [
    (flip_middle_of_wal, "", r"q\.sqlite is older than its log: .*Restore the newest q\.sqlite with its -wal file"),
    (lambda tmp: (tmp / "q.sqlite-wal").unlink(), "", r"q\.sqlite is older than its log"),
    (garble_mark, "", r"mark .*q\.mark is damaged .*'slurm-elastic rollout st0re.*delete .*q\.mark"),
    (lambda tmp: None, "UPDATE groups SET state='bogus' WHERE id='g5'", r"1 group row\(s\) .*id 'g5'"),
    (lambda tmp: None, "INSERT OR REPLACE INTO meta VALUES ('staleness', '{')", r"unreadable staleness snapshot"),
], ids=["flipped-wal-byte", "deleted-wal", "garbled-mark", "foreign-row", "bad-staleness"])
def test_a_refused_open_leaves_the_index_its_wal_and_shm_as_they_were(
        tmp_path: Path, damage: Callable[[Path], object], edit: str, says: str) -> None:
    killed_with_a_live_wal(tmp_path, edit)
    damage(tmp_path)
    before = digests(tmp_path)
    for _ in range(2):  # and again: a restarted controller is refused the same way
        with pytest.raises(StateFileError, match=says):
            RolloutStore(tmp_path / "q.sqlite", lock_wait_s=5)
        assert digests(tmp_path) == before


def test_a_damaged_index_page_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    killed_with_a_live_wal(tmp_path)
    path = tmp_path / "q.sqlite"
    data = bytearray(path.read_bytes())
    for k in range(7):
        data[100 + k] ^= 0x55  # the first page's b-tree header, under the schema
    path.write_bytes(bytes(data))
    before = digests(tmp_path)
    with pytest.raises(StateFileError, match=r"q\.sqlite is (unusable|damaged)"):
        RolloutStore(path, lock_wait_s=5)
    assert digests(tmp_path) == before


def test_an_index_restored_with_its_wal_but_no_shm_opens_whole(tmp_path: Path) -> None:
    """What the refusal says to do: the -shm, which the read-only look makes for itself, is not needed."""
    killed_with_a_live_wal(tmp_path)
    (tmp_path / "q.sqlite-shm").unlink()
    store = RolloutStore(tmp_path / "q.sqlite", lock_wait_s=5)
    assert store.counts() == {"delivered": 160}
    store.close()
    assert not os.path.exists(tmp_path / "q.sqlite-wal")  # a normal close checkpoints as before
