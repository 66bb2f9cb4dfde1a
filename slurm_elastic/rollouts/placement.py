"""Finding group records that are not where the index places them: segment files swapped,
renamed, or one replaced by a copy.

A record carries its group's head (arrival number, id, worker, size, version) and a CRC32 over
head and body, so it proves which group it holds wherever it lies, as the checked read does at
the place the index gives (:meth:`segments.SegmentLog.read_checked`). At open, before the index
is opened for writing, :func:`place_records` reads the header and head of every undelivered
group's record, and of the newest row's (where replaying the log starts), at the index's place.
Only if an undelivered one is not there are the segment files read whole, oldest first, until
every record not there is found (:func:`whole_records`, which steps over damage to the next
record); a record found with that head, size and a good CRC is where the row is moved
(:meth:`index.StoreIndex.move`, logged). The newest row's record alone not there (a delivered
group's, or a lost one's whose record is damaged) is not searched for: replaying starts past the
index's place, as before the files could move. A record found nowhere is left to the
checks at open: a missing segment is refused, a damaged record quarantined, its file kept.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.index import LIVE_STATES
from slurm_elastic.rollouts.inspection import read_only
from slurm_elastic.rollouts.segments import (
    HEADER,
    MAGIC,
    find_whole_records,
    group_head,
    json_str,
    scan_from,
    segment_name,
    segment_numbers,
)

ROWS_SQL = ("SELECT seq, id, worker_id, n_seqs, version, nbytes, segment, body_offset FROM groups "
            f"WHERE segment IS NOT NULL AND (state IN {LIVE_STATES} OR seq = (SELECT MAX(seq) FROM groups)) "
            "ORDER BY seq")


class Placement(NamedTuple):
    """Where the records are: ``moves`` (arrival number -> segment, body offset) for rows whose
    record was found elsewhere; with those moves, the undelivered groups per segment, where
    replaying the log starts, and per segment where its last undelivered record ends."""

    moves: dict[int, tuple[int, int]]
    live_segments: dict[int, int]
    replay_from: tuple[int, int]
    live_ends: dict[int, int]


def whole_records(path: Path) -> Iterator[tuple[bytes, int, int]]:
    """Every whole record in ``path`` whose CRC holds, wherever it starts (past damage, the
    search goes on at the next magic): (head, body offset, body size)."""
    return find_whole_records(path.read_bytes())


def _at_place(log_dir: Path, fds: dict[int, int | None], segment: int, body_offset: int, head: bytes,
              nbytes: int) -> bool:
    """Whether the record with ``head`` and a body of ``nbytes`` starts where the index says
    (header and head only: the checks at open read the body and its CRC)."""
    if segment not in fds:
        try:
            fds[segment] = os.open(log_dir / segment_name(segment), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            fds[segment] = None
    fd = fds[segment]
    start = body_offset - len(head) - HEADER.size
    if fd is None or start < 0:
        return False
    prefix = os.pread(fd, HEADER.size + len(head), start)
    if len(prefix) != HEADER.size + len(head):
        return False
    magic, _crc, head_len, body_len = HEADER.unpack_from(prefix)
    return magic == MAGIC and head_len == len(head) and body_len == nbytes and prefix[HEADER.size:] == head


def place_records(path: Path, log_dir: Path) -> Placement:
    """Read-only: where each undelivered group's record is, and the newest row's (see the module)."""
    with read_only(path) as db:
        rows = [(int(r[0]), group_head(r[0], json_str(r[1]), json_str(r[2]), r[3], r[4]), int(r[5]), int(r[6]),
                 int(r[7])) for r in db.execute(ROWS_SQL)]
        last = db.execute("SELECT MAX(seq) FROM groups").fetchone()[0]
        live = {int(r[0]) for r in db.execute(f"SELECT seq FROM groups WHERE state IN {LIVE_STATES}")}
    segment_numbers(log_dir)  # refuses a segment that is not a regular file before one is opened
    fds: dict[int, int | None] = {}
    try:  # the newest row only if it is undelivered or its segment is there (else it is no place to replay from)
        away = [row for row in rows if (row[0] in live or (log_dir / segment_name(row[3])).exists())
                and not _at_place(log_dir, fds, row[3], row[4], row[1], row[2])]
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
    moves: dict[int, tuple[int, int]] = {}
    if any(row[0] in live for row in away):  # the newest row alone, delivered or lost: no search
        wanted = {(head, nbytes): seq for seq, head, nbytes, _s, _o in away}
        for number in segment_numbers(log_dir):
            for head, body_offset, nbytes in whole_records(log_dir / segment_name(number)):
                seq = wanted.pop((head, nbytes), None)
                if seq is not None:
                    moves[seq] = (number, body_offset)
            if not wanted:
                break
    places = {seq: moves.get(seq, (segment, offset)) for seq, _h, _n, segment, offset in rows}
    sizes = {seq: nbytes for seq, _h, nbytes, _s, _o in rows}
    live_segments: dict[int, int] = {}
    live_ends: dict[int, int] = {}
    for seq in live & places.keys():
        segment, offset = places[seq]
        live_segments[segment] = live_segments.get(segment, 0) + 1
        live_ends[segment] = max(live_ends.get(segment, 0), offset + sizes[seq])
    replay_from = (0, 0) if last not in places else (places[last][0], places[last][1] + sizes[last])
    return Placement(moves, live_segments, replay_from, live_ends)


def refuse_foreign_records(path: Path, log_dir: Path, replay_from: tuple[int, int]) -> None:
    """Read-only: StateFileError if the log past the index (from ``replay_from``, what open
    indexes again) holds a record with an arrival number the index gives another group: a
    segment of another store put here, whose later groups would be indexed and handed out as
    this one's. (Records the index has, as after segments swapped, are skipped as before.)"""
    numbers = segment_numbers(log_dir)
    seen = [(n, r) for n, records, _end, _size in scan_from(log_dir, numbers, *replay_from) for r in records]
    if not seen:
        return
    seqs = [int(r.head["seq"]) for _n, r in seen]
    with read_only(path) as db:  # after a crash, records past the index: none of those rows
        known = {int(r[0]): r[1:] for r in db.execute(
            "SELECT seq, id, worker_id, n_seqs, version, nbytes FROM groups WHERE seq BETWEEN ? AND ?",
            (min(seqs), max(seqs)))}
    for n, r in seen:
        row = known.get(int(r.head["seq"]))
        if row is not None and (r.head["id"], r.head["worker_id"], r.head["n_seqs"], r.head["version"],
                                r.body_bytes) != tuple(row):
            raise StateFileError(
                f"payload log segment {log_dir / segment_name(n)} holds a record of arrival number {r.head['seq']} "
                f"(group {r.head['id']!r}) where the index {path.name} stored group {row[0]!r}: a segment of "
                "another store? Its groups would be handed out as this job's. Nothing was changed. Move that file "
                "aside (or put back the one it replaced)")
