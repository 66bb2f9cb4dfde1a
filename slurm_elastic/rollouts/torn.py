"""Telling a torn write at the end of the payload log from other bytes, read-only, at open.

After a crash, what the newest segment holds past its whole records is cut off only if a commit
cut short can have left it there. The controller has one commit at a time with the syncer and is
answered once it is durable (:mod:`commits`), so at most one commit is not: its records, written
in one write from where the whole records end (with O_DIRECT in whole blocks, zeros after the
last record up to the block's end: :data:`segments.BLOCK_BYTES`). A crash leaves each sector of
it (:data:`SECTOR_BYTES`, what a disk writes whole) new or as it was: zeros, past the file's old
end or in its padding; a killed process leaves a prefix of it. So those bytes are torn
(:func:`looks_torn`) when they are

- zeros to the file's end, however many (nothing is lost by cutting zeros); or
- the start of a record: each byte of its magic the magic's own or a zero with only zeros after
  it to its sector's end (a write cut short there, or a sector not written), its size fields
  (zero where not written: never above what was written) a head of at most
  :data:`HEAD_MAX_BYTES` and a body of at most ``MAX_GROUP_BYTES``; and no more bytes than the
  largest commit and a block of padding (:data:`TORN_MAX_BYTES`).

Other bytes (another file's, a segment swapped or renamed into place) are refused, nothing
changed (:func:`refuse_damaged_log`). A file whose bytes there start with a sector of zeros is
taken for a commit whose first sector was not written: cut if no longer than one commit.
"""

from __future__ import annotations

import os
from pathlib import Path

from slurm_elastic.core.limits import MAX_GROUP_BYTES
from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.commits import COMMIT_BYTES, ROWS_PER_COMMIT
from slurm_elastic.rollouts.segments import (
    BLOCK_BYTES,
    HEADER,
    MAGIC,
    refuse_damage,
    scan_from,
    segment_name,
    segment_numbers,
)

SECTOR_BYTES = 512  # the smallest unit a disk writes whole
HEAD_MAX_BYTES = 64 * 1024  # a head: ids of at most 128 and 64 characters, JSON-escaped, and 4 numbers
TORN_MAX_BYTES = max(COMMIT_BYTES + ROWS_PER_COMMIT * (HEADER.size + HEAD_MAX_BYTES),  # several groups
                     HEADER.size + HEAD_MAX_BYTES + MAX_GROUP_BYTES) + BLOCK_BYTES  # or one, alone
ZEROS_CHUNK_BYTES = 1 << 20


def sector_end(offset: int) -> int:
    return (offset // SECTOR_BYTES + 1) * SECTOR_BYTES


def _maybe_unwritten(data: bytes, end: int, i: int) -> bool:
    """Whether byte ``i`` of ``data`` (read from byte ``end`` of the file) is a zero with only
    zeros after it to its sector's end: a write cut short there, or a sector not written."""
    return not data[i:sector_end(end + i) - end].strip(b"\0")


def _zeros_to_end(fd: int, start: int, size: int) -> bool:
    pos = start
    while pos < size:
        chunk = os.pread(fd, min(ZEROS_CHUNK_BYTES, size - pos), pos)
        if not chunk or chunk.strip(b"\0"):
            return False
        pos += len(chunk)
    return True


def looks_torn(path: Path, end: int) -> bool:
    """Whether what ``path`` holds from ``end`` (where its whole records end) can be a commit cut
    short (see the module)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, sector_end(end + HEADER.size) - end, end)
        if not data.strip(b"\0"):  # the record's header, if any, was not written: zeros or a later sector
            return size - end <= TORN_MAX_BYTES or _zeros_to_end(fd, end, size)
        if any(data[i] != MAGIC[i] and not _maybe_unwritten(data, end, i) for i in range(min(len(data), len(MAGIC)))):
            return False
        if len(data) >= HEADER.size:
            _magic, _crc, head_len, body_len = HEADER.unpack_from(data)
            if head_len > HEAD_MAX_BYTES or body_len > MAX_GROUP_BYTES:
                return False
        return size - end <= TORN_MAX_BYTES
    finally:
        os.close(fd)


def refuse_damaged_log(directory: Path, number: int, offset: int, live_ends: dict[int, int]) -> None:
    """Read-only: StateFileError if a segment older than the newest holds a bad record past
    (``number``, ``offset``), where replay starts, or the newest holds bytes there that
    :meth:`segments.SegmentLog.records_after` would cut off and that are no torn write
    (:func:`looks_torn`) or hold a group the index places there (``live_ends``: per segment,
    where its last such record ends): another file's bytes (segments swapped, renamed, or a file
    put there), which cutting would destroy. Found before the index is opened for writing, so a
    refusal changes nothing."""
    numbers = segment_numbers(directory)
    for n, _records, end, size in scan_from(directory, numbers, number, offset):
        path = directory / segment_name(n)
        if n != numbers[-1]:
            refuse_damage(path, end, size)
        elif end != size and (not looks_torn(path, end) or end < live_ends.get(n, 0)):
            raise StateFileError(
                f"payload log segment {path}, the newest, holds {size - end} byte(s) from byte {end} that are not "
                "the torn end of a write (nor whole records of this store): segment files swapped or renamed, a "
                "file put in its place, or a power cut with fsync = \"os\" or \"off\" that left more than one "
                "commit unwritten? Nothing was changed. Put the segments back as they were; after a power cut, copy "
                f"the file aside and cut it to its whole records (truncate -s {end} {path}: the groups past byte "
                f"{end} are lost, those before it kept); or move this one aside (all its groups are then missing, "
                "and the store says what to do)")
