"""What the newest segment holds past its whole records after a crash: a commit cut short (at a
byte, or a sector not written) is cut off; other bytes, even ones that start with a zero or the
record's magic, are refused, every file left as it was. And what opening reads to find records
that moved: no segment file read whole when only the newest row's record is not where it was."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts import placement, torn
from slurm_elastic.rollouts.segments import HEADER, MAGIC, encode_record, scan
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.rollouts.torn import looks_torn


def body(group_id: str) -> bytes:
    return json.dumps({"id": group_id, "pad": "x" * 300}).encode()


def everything(tmp: Path) -> dict[str, bytes]:
    return {str(p.relative_to(tmp)): p.read_bytes() for p in sorted(tmp.rglob("*")) if p.is_file() and p.name != "q.lock"}


def three_groups(tmp: Path) -> tuple[Path, int, bytes]:
    """g0-g2 stored; the newest segment, where g2's record starts, and that record's bytes."""
    store = RolloutStore(tmp / "q.sqlite")
    for name in ["g0", "g1", "g2"]:
        assert store.insert(name, "w", 4, 0, body(name)) is not None
    store.close()
    (path,) = (tmp / "q.segments").iterdir()
    records, _end = scan(path)
    start = records[1].end
    return path, start, path.read_bytes()[start:records[2].end]


def test_a_record_cut_short_anywhere_in_its_header_with_zeros_after_is_cut_off(tmp_path: Path) -> None:
    """Before, a cut inside the magic (b"SE" or b"S" then zeros: a sector or page boundary there)
    was refused as another file's bytes, blaming swapped files."""
    base = tmp_path / "base"
    base.mkdir()
    path, start, record = three_groups(base)
    size = path.stat().st_size
    for keep in range(HEADER.size + 3):
        case = tmp_path / str(keep)
        shutil.copytree(base, case)
        seg = case / "q.segments" / path.name
        data = bytearray(seg.read_bytes())
        data[start:] = record[:keep] + bytes(size - start - keep)
        seg.write_bytes(bytes(data))
        with sqlite3.connect(case / "q.sqlite") as db:  # killed before the index
            db.execute("DELETE FROM groups WHERE id = 'g2'")
        store = RolloutStore(case / "q.sqlite")
        assert [g.id for g in store.queued()] == ["g0", "g1"], keep
        store.close()
        assert seg.stat().st_size == start


def record_at(end: int, tail: bytes, tmp: Path) -> Path:
    path = tmp / "00000001.log"
    path.write_bytes(b"x" * end + tail)
    return path


def test_sectors_not_written_are_zeros_and_say_nothing(tmp_path: Path) -> None:
    """A disk writes each 512-byte sector whole or not at all, in any order."""
    record = encode_record({"seq": 3, "id": "g2"}, b"b" * 2000)
    for end in (0, 100, 506, 510, 511):
        boundary = 512 - end % 512
        unwritten = bytes(boundary) + record[boundary:]  # the sector holding the record's start not written
        assert looks_torn(record_at(end, unwritten, tmp_path), end), end
        assert looks_torn(record_at(end, record[:boundary] + bytes(len(record) - boundary), tmp_path), end), end
        assert looks_torn(record_at(end, bytes(5000), tmp_path), end)
        assert looks_torn(record_at(end, b"", tmp_path), end)


@pytest.mark.parametrize("tail", [b"\0" + b"\xff" * 5000, MAGIC + b"\xff" * 5000, b"\0\0R1" + b"\xff" * 5000,
                                  b"SX" + bytes(5000)], ids=["zero-led", "magic-led", "torn-magic-mid-sector", "not-magic"])
def test_other_bytes_are_no_torn_write_even_led_by_a_zero_or_the_magic(tmp_path: Path, tail: bytes) -> None:
    assert not looks_torn(record_at(100, tail, tmp_path), 100)


def test_a_torn_write_is_no_longer_than_one_commit_unless_zeros(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torn, "TORN_MAX_BYTES", 4096)
    record = encode_record({"seq": 3, "id": "g2"}, b"b" * 5000)
    assert looks_torn(record_at(0, record[:4096], tmp_path), 0)
    assert not looks_torn(record_at(0, record, tmp_path), 0)
    assert looks_torn(record_at(0, bytes(3 * 4096 + 5), tmp_path), 0)
    assert not looks_torn(record_at(0, bytes(3 * 4096) + b"\1", tmp_path), 0)
    assert looks_torn(record_at(0, bytes(512) + b"\xff" * 3000, tmp_path), 0)  # the first sector not written


@pytest.mark.parametrize("first", [b"\0", MAGIC], ids=["zero", "magic"])
def test_a_foreign_file_led_by_a_zero_or_the_magic_is_refused_not_emptied(tmp_path: Path, first: bytes) -> None:
    """Before, 00000099.log holding b"\\0" or b"SER1" and then 200 KB of another file was opened
    and cut to 0 bytes."""
    three_groups(tmp_path)
    (tmp_path / "q.segments" / "00000099.log").write_bytes(first + b"\xa5" * 200_000)
    before = everything(tmp_path)
    with pytest.raises(StateFileError, match=r"holds \d+ byte\(s\) from byte 0 that are not the torn end of a write"):
        RolloutStore(tmp_path / "q.sqlite")
    assert everything(tmp_path) == before


def test_no_segment_is_read_whole_when_only_the_newest_rows_record_is_not_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a newest group lost with a damaged record had every segment file read whole at
    every open (206 files for 10,000 groups)."""
    store = RolloutStore(tmp_path / "q.sqlite", segment_bytes=800)
    for i in range(12):
        assert store.insert(f"g{i}", "w", 4, 0, body(f"g{i}")) is not None
    store.close()
    newest = sorted(p for p in (tmp_path / "q.segments").iterdir() if p.stat().st_size)[-1]
    _records, end = scan(newest)
    newest.write_bytes(newest.read_bytes()[:end - 100])  # cut in the last record: its group is lost at open
    store = RolloutStore(tmp_path / "q.sqlite")
    assert [g.id for g in store.lost()] == ["g11"]
    store.close()
    read: list[Path] = []
    whole_records = placement.whole_records
    monkeypatch.setattr(placement, "whole_records", lambda path: (read.append(path), whole_records(path))[1])
    for _ in range(2):
        store = RolloutStore(tmp_path / "q.sqlite")
        assert len(store.queued()) == 11
        store.close()
    assert read == []


def test_a_cut_says_so_and_counts_whole_records_past_the_hole(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """fsync = "os": a power cut may tear a commit while a later one reached the disk. The later
    group's whole record is cut with the torn one (the log cannot be read on past a hole), and the
    open says so rather than losing it without a word."""
    store = RolloutStore(tmp_path / "q.sqlite")
    for name in ["g0", "g1", "g2", "g3"]:
        assert store.insert(name, "w", 4, 0, body(name)) is not None
    store.close()
    (seg,) = (tmp_path / "q.segments").iterdir()
    records, _end = scan(seg)
    data = bytearray(seg.read_bytes())
    hole = records[1].end + 512 - records[1].end % 512  # g2's second sector on: not written
    data[hole:records[2].end] = bytes(records[2].end - hole)
    seg.write_bytes(bytes(data))
    with sqlite3.connect(tmp_path / "q.sqlite") as db:  # the index rows lost with the power cut
        db.execute("DELETE FROM groups WHERE id IN ('g2', 'g3')")
    with caplog.at_level("WARNING", logger="slurm_elastic.rollouts.segments"):
        store = RolloutStore(tmp_path / "q.sqlite")
    assert [g.id for g in store.queued()] == ["g0", "g1"]
    store.close()
    assert f"cutting {len(data) - records[1].end} byte(s) from byte {records[1].end}" in caplog.text, caplog.text
    assert "1 whole record(s) past it are cut with it" in caplog.text
