"""A bad record in an older segment of the payload log, past what the index holds, on the real
store on disk: refused at open before the index is opened for writing, so the index, its ``-wal``
and ``-shm`` files and the segments are left byte for byte as they were (before, the refusal came
after a read-write open, whose close checkpointed the ``-wal`` into the index and deleted it). A
torn tail of the newest segment is still cut off and the store opens."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.segments import encode_record, scan
from slurm_elastic.rollouts.store import RolloutStore

SEGMENT_BYTES = 4096
GROUPS = 16
KEPT_COMMITS = 2  # index rows that survive the power cut: g0 and g1, both in segment 1


def body(i: int) -> bytes:
    return json.dumps({"id": f"g{i}", "pad": "x" * 1000}).encode()


def killed_after_groups(tmp: Path) -> None:
    """In a child process: ``GROUPS`` 1 kB groups, one commit each, over several 4 kB segments,
    then kill -9 of it and its syncer (the index rows live in the ``-wal``)."""
    script = textwrap.dedent(f"""
        import json, os, signal
        from pathlib import Path
        from slurm_elastic.rollouts.store import RolloutStore
        path = Path({str(tmp / "q.sqlite")!r})
        RolloutStore(path, segment_bytes={SEGMENT_BYTES}).close()  # the tables, in the index file itself
        store = RolloutStore(path, segment_bytes={SEGMENT_BYTES})
        for i in range({GROUPS}):
            store.insert(f"g{{i}}", "0007", 4, 0, json.dumps({{"id": f"g{{i}}", "pad": "x" * 1000}}).encode())
        os.killpg(0, signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], check=False, start_new_session=True)
    assert done.returncode == -9
    assert (tmp / "q.sqlite-wal").stat().st_size > 0 and (tmp / "q.sqlite-shm").exists()


def cut_wal_after_commits(tmp: Path, commits: int) -> None:
    """A power cut under ``synchronous=NORMAL``: the ``-wal`` keeps its first ``commits`` transactions
    (the log, fdatasynced before any answer, keeps every record)."""
    path = tmp / "q.sqlite-wal"
    data = path.read_bytes()
    page_size = struct.unpack_from(">I", data, 8)[0]
    pos, seen = 32, 0
    while seen < commits:
        assert pos + 24 + page_size <= len(data), "fewer commits in the -wal than asked for"
        seen += struct.unpack_from(">I", data, pos + 4)[0] != 0  # a commit frame holds the database size
        pos += 24 + page_size
    path.write_bytes(data[:pos])


def segments(tmp: Path) -> list[Path]:
    return sorted((tmp / "q.segments").glob("*.log"))


def digests(tmp: Path) -> dict[str, str | None]:
    names = ["q.sqlite", "q.sqlite-wal", "q.sqlite-shm", "q.mark", *(f"q.segments/{p.name}" for p in segments(tmp))]
    return {name: hashlib.sha256((tmp / name).read_bytes()).hexdigest() if (tmp / name).exists() else None
            for name in names}


def indexed_ids(tmp: Path) -> list[str]:
    """The groups the index holds after the cut, read from a copy (the store's files stay untouched)."""
    copy = tmp / "copy"
    copy.mkdir()
    for suffix in ("", "-wal"):
        (copy / f"q.sqlite{suffix}").write_bytes((tmp / f"q.sqlite{suffix}").read_bytes())
    with sqlite3.connect(copy / "q.sqlite") as db:
        return [r[0] for r in db.execute("SELECT id FROM groups ORDER BY seq")]


@pytest.fixture
def index_behind_log(tmp_path: Path) -> Path:
    """A store whose index holds g0 and g1 (segment 1, its ``-wal`` live) while the log holds
    g0..g15 over at least four segments."""
    killed_after_groups(tmp_path)
    cut_wal_after_commits(tmp_path, KEPT_COMMITS)
    assert indexed_ids(tmp_path) == ["g0", "g1"]
    assert len(segments(tmp_path)) >= 4
    return tmp_path


def test_a_bad_record_in_an_older_segment_past_the_index_is_refused_changing_nothing(index_behind_log: Path) -> None:
    tmp = index_behind_log
    second = segments(tmp)[1]  # older than the newest, wholly past the index
    records, _end = scan(second)
    assert len(records) >= 2
    data = bytearray(second.read_bytes())
    data[records[1].body_offset + 20] ^= 0x01  # its second record fails its checksum
    second.write_bytes(bytes(data))
    damaged_at = records[0].end  # where the second record starts
    before = digests(tmp)
    for _ in range(2):  # and again: a restarted controller is refused the same way
        with pytest.raises(StateFileError, match=rf"payload log segment .*{second.name} is damaged at byte {damaged_at}$"):
            RolloutStore(tmp / "q.sqlite", segment_bytes=SEGMENT_BYTES, lock_wait_s=5)
        assert digests(tmp) == before


def test_a_torn_tail_of_the_newest_segment_is_still_cut_off(index_behind_log: Path) -> None:
    tmp = index_behind_log
    newest = segments(tmp)[-1]
    _records, whole = scan(newest)
    with open(newest, "ab") as f:
        f.write(encode_record({"seq": 99, "id": "torn"}, body(99))[:40])  # a commit cut short
    store = RolloutStore(tmp / "q.sqlite", segment_bytes=SEGMENT_BYTES, lock_wait_s=5)
    try:
        assert [g.id for g in store.queued()] == [f"g{i}" for i in range(GROUPS)]  # found again in the log
        assert newest.stat().st_size == whole
        payloads = store.hand_out("b", [f"g{i}" for i in range(GROUPS)], 1.0)
        assert [json.loads(p)["id"] for p in payloads] == [f"g{i}" for i in range(GROUPS)]
    finally:
        store.close()
