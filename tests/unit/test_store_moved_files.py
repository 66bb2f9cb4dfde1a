"""Segment files swapped, renamed, replaced or put beside the log, a record torn at every byte,
and a second writer once the lock file was deleted: on the real store on disk. A record names its
group (arrival number, id, worker, size, version) and its CRC covers that, so one found in another
file than the index says is read there; bytes that are no torn write are never cut off; a file
whose groups were quarantined is kept; what cannot be repaired is refused, nothing changed."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.segments import HEADER, scan
from slurm_elastic.rollouts.store import RolloutStore


def body(group_id: str) -> bytes:
    return json.dumps({"id": group_id, "pad": "x" * 300}).encode()


def filled(tmp: Path, n: int = 12, reopen: bool = True) -> list[str]:
    """``n`` groups, three a segment (00000001.log holds g0-g2, ...); ``reopen``: opened again
    once, so the newest segment is an empty one and those are older."""
    store = RolloutStore(tmp / "q.sqlite", segment_bytes=800)
    names = [f"g{i}" for i in range(n)]
    for name in names:
        assert store.insert(name, "w", 4, 0, body(name)) is not None
    store.close()
    if reopen:
        RolloutStore(tmp / "q.sqlite").close()
    return names


def served(tmp: Path) -> tuple[list[str], list[str]]:
    """Every queued group's payload, checked, as a trainer gets them; and the lost ones."""
    store = RolloutStore(tmp / "q.sqlite")
    try:
        payloads = store.hand_out("b", [g.id for g in store.queued()], 1.0)
        return [json.loads(p)["id"] for p in payloads], [g.id for g in store.lost()]
    finally:
        store.close()


def files(tmp: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((tmp / "q.segments").iterdir())}


def everything(tmp: Path) -> dict[str, bytes]:
    """The store's files (the lock file names its holders: not the store's data)."""
    return {str(p.relative_to(tmp)): p.read_bytes() for p in sorted(tmp.rglob("*")) if p.is_file() and p.name != "q.lock"}


def rename(seg: Path, *names: str) -> None:
    """Rotate the files: the first takes the second's name, ..., the last the first's."""
    for i, name in enumerate(names):
        (seg / name).rename(seg / f"t{i}")
    for i in range(len(names)):
        (seg / f"t{i}").rename(seg / names[(i + 1) % len(names)])


@pytest.mark.parametrize("reopen", [True, False], ids=["older", "with-the-newest"])
def test_swapped_segments_lose_nothing(tmp_path: Path, reopen: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Before, every group of both files was quarantined and both files deleted (a hostile test)."""
    names = filled(tmp_path, reopen=reopen)
    seg = tmp_path / "q.segments"
    newest = sorted(p.name for p in seg.iterdir() if p.stat().st_size)[-1]
    rename(seg, "00000001.log", newest)
    with caplog.at_level(logging.WARNING):
        assert served(tmp_path) == (names, [])
    assert "found whole in other segment files" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        RolloutStore(tmp_path / "q.sqlite").close()  # the index points there now
    assert "found whole" not in caplog.text


def test_segments_renamed_in_a_ring_or_to_a_new_number_lose_nothing(tmp_path: Path) -> None:
    names = filled(tmp_path)
    seg = tmp_path / "q.segments"
    rename(seg, "00000001.log", "00000002.log", "00000003.log")
    (seg / "00000004.log").rename(seg / "00000040.log")
    assert served(tmp_path) == (names, [])


def test_a_segment_renamed_out_of_the_numbering_is_refused_as_missing_and_left_alone(tmp_path: Path) -> None:
    filled(tmp_path)
    seg = tmp_path / "q.segments"
    (seg / "00000001.log").rename(seg / "1.log")  # not segment 1: a segment's name has 8 digits
    before = everything(tmp_path)
    with pytest.raises(StateFileError, match=r"missing \(00000001.log\)"):
        RolloutStore(tmp_path / "q.sqlite")
    assert everything(tmp_path) == before


@pytest.mark.parametrize("where", ["past-the-newest-records", "a-new-newest-file"])
def test_bytes_that_are_no_torn_write_are_refused_not_cut_off(tmp_path: Path, where: str) -> None:
    """Before, the newest segment was cut where its whole records ended, whatever followed: a
    file put there as 00000099.log was emptied, and its groups' file deleted."""
    filled(tmp_path, reopen=False)
    seg = tmp_path / "q.segments"
    newest = sorted(seg.iterdir())[-1]
    foreign = os.urandom(5000).replace(b"\0", b"\1").replace(b"S", b"s")
    if where == "a-new-newest-file":
        (seg / "00000099.log").write_bytes(foreign)
    else:
        _records, end = scan(newest)
        newest.write_bytes(newest.read_bytes()[:end - 200] + foreign)  # the last record's end overwritten
    before = everything(tmp_path)
    with pytest.raises(StateFileError, match=r"not the torn end of a write.*Nothing was changed"):
        RolloutStore(tmp_path / "q.sqlite")
    assert everything(tmp_path) == before


def test_a_file_whose_groups_were_all_quarantined_is_kept_and_said(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Before, quarantining the last live group of a segment deleted the file: the evidence of
    what happened, and what an operator might still have read back."""
    names = filled(tmp_path)
    seg = tmp_path / "q.segments"
    (seg / "00000002.log").write_bytes(os.urandom(2500))  # another file's bytes in its place
    with caplog.at_level(logging.WARNING):
        ok, lost = served(tmp_path)
    assert lost == names[3:6] and ok == names[:3] + names[6:]
    assert (seg / "00000002.log").stat().st_size == 2500
    assert "kept only for groups quarantined" in caplog.text
    store = RolloutStore(tmp_path / "q.sqlite")  # and every open after
    assert store.ack("b") and (seg / "00000002.log").exists() and not (seg / "00000001.log").exists()
    store.close()


def test_a_torn_last_record_at_every_byte_is_cut_off_or_quarantined_never_served(tmp_path: Path) -> None:
    """The newest segment cut at bytes across its last record and the padding after it, with the
    record's index row (the commit was answered: the group is lost, said) and without it (the
    controller died before the index: the record is a torn write, cut off)."""
    base = tmp_path / "base"
    base.mkdir()
    store = RolloutStore(base / "q.sqlite")
    for name in ["g0", "g1", "g2"]:
        assert store.insert(name, "w", 4, 0, body(name)) is not None
    store.close()
    (path,) = (base / "q.segments").iterdir()
    records, end = scan(path)
    start, size = records[1].end, path.stat().st_size
    head_end = start + HEADER.size + len(json.dumps(records[2].head, separators=(",", ":")))
    edges = (0, 1, 3, 4, HEADER.size - 1, HEADER.size, head_end - start - 1, head_end - start, head_end - start + 1)
    cuts = sorted({*(start + e for e in edges), *range(start, end, 23), end - 1, end, end + 1, size})
    for with_row in (True, False):
        for cut in cuts:
            case = tmp_path / f"{with_row}-{cut}"
            shutil.copytree(base, case)
            os.truncate(case / "q.segments" / path.name, cut)
            if not with_row:
                with sqlite3.connect(case / "q.sqlite") as db:
                    db.execute("DELETE FROM groups WHERE id = 'g2'")
            whole = cut >= end
            expected = (["g0", "g1", "g2"] if whole else ["g0", "g1"], ["g2"] if with_row and not whole else [])
            assert served(case) == expected, (with_row, cut)
            shutil.rmtree(case)


def test_a_second_store_is_refused_when_the_lock_file_was_deleted_under_the_first(tmp_path: Path) -> None:
    """Before, it opened: both numbered their next group 2, and the first's was taken for one
    stored already, answered as stored and never indexed (an acknowledged group lost)."""
    first = RolloutStore(tmp_path / "q.sqlite")
    assert first.insert("a1", "w", 4, 0, body("a1")) is not None
    (tmp_path / "q.lock").unlink()
    with pytest.raises(StateFileError, match="is in use: another process holds its payload log"):
        RolloutStore(tmp_path / "q.sqlite", lock_wait_s=0)
    assert first.insert("a2", "w", 4, 0, body("a2")) is not None
    assert [g.id for g in first.queued()] == ["a1", "a2"]
    first.close()
    assert served(tmp_path) == (["a1", "a2"], [])


def test_a_segment_of_another_store_put_in_the_log_is_refused_not_served(tmp_path: Path) -> None:
    """Before, its groups numbered past this store's were indexed and handed out as this job's."""
    for name, n in (("a", 3), ("b", 8)):
        (tmp_path / name).mkdir()
        store = RolloutStore(tmp_path / name / "q.sqlite")
        for i in range(n):
            assert store.insert(f"{name}{i}", name, 4, 0, body(f"{name}{i}")) is not None
        store.close()
    shutil.copy(tmp_path / "b" / "q.segments" / "00000001.log", tmp_path / "a" / "q.segments" / "00000099.log")
    before = everything(tmp_path / "a")
    with pytest.raises(StateFileError, match=r"arrival number 1 \(group 'b0'\) where the index q.sqlite stored group 'a0'"):
        RolloutStore(tmp_path / "a" / "q.sqlite")
    assert everything(tmp_path / "a") == before
    (tmp_path / "a" / "q.segments" / "00000099.log").unlink()
    assert served(tmp_path / "a") == (["a0", "a1", "a2"], [])


def test_a_segment_that_cannot_be_read_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a segment this user may not read (the tests run as root, whom modes do not stop)."""
    filled(tmp_path)
    real_open = os.open

    def refusing(path: object, *args: object, **kwargs: object) -> int:
        if str(path).endswith("00000001.log"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(os, "open", refusing)
    with pytest.raises(StateFileError, match=r"reading its payload log: .*Permission denied.*00000001.log"):
        RolloutStore(tmp_path / "q.sqlite")
