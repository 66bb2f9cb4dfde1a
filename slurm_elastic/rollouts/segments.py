"""The payload log: rollout group bodies appended to segment files in the job's state directory.

A record is a fixed header, a small JSON head naming the group and its arrival number, and the
group's body exactly as the worker sent it::

    magic b"SER1" | crc32(head + body) u32 | head length u32 | body length u32 | head | body

The controller lays a commit's records out in a staging buffer shared with the syncer process
(:class:`StagingBuffer`), leaving each checksum blank; the syncer fills the checksums in, writes
the records to the segment with one write and makes them durable (fdatasync) before anyone is
answered. So the event loop only copies bytes in memory; the checksums, the write and the wait
for the disk are another process's work. With ``fsync = "always"`` the write bypasses the page
cache (O_DIRECT), so it goes in whole blocks of :data:`BLOCK_BYTES` from a block boundary: the
records are staged at their offset within their first block, the bytes of that block already
on disk are put in front of them and zeros after them up to the next boundary, which the next
commit overwrites. So a segment may end with fewer than :data:`BLOCK_BYTES` zeros: padding, not
a record. Segments roll over at ``segment_bytes`` and are deleted once no group in them is
waiting or handed out. After a crash the records past what the database knows are read back
(:func:`scan`); a torn record can only be the last segment's tail, from a commit nobody was
answered for, and is cut off (only bytes that can be a commit cut short: :func:`torn.looks_torn`).
A bad record in an older segment is damage: found read-only before the index is opened for
writing (:func:`torn.refuse_damaged_log`), so the refusal changes nothing.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any

from slurm_elastic.errors import StateFileError

log = logging.getLogger(__name__)

MAGIC = b"SER1"
HEADER = struct.Struct("<4sIII")
CRC = struct.Struct("<I")  # at byte 4 of the header; covers head and body
SEGMENT_BYTES = 64 * 1024 * 1024
BLOCK_BYTES = 4096  # the unit of a direct write: a multiple of any disk's logical block size


def block_end(offset: int) -> int:
    return -(-offset // BLOCK_BYTES) * BLOCK_BYTES


def segment_name(number: int) -> str:
    return f"{number:08d}.log"


def json_str(text: str) -> bytes:
    """``text`` as a JSON string, as ``json.dumps(text)`` writes it (its C encoder, called
    directly, without ``json.dumps``' work per call)."""
    return encode_basestring_ascii(text).encode()


def group_head(seq: int, group_id_json: bytes, worker_id_json: bytes, n_seqs: int, version: int) -> bytes:
    """A group record's head (ids given as :func:`json_str`): the JSON ``json.dumps(...,
    separators=(",", ":"))`` would write, by one bytes format (it is built per submit)."""
    return (b'{"seq":%d,"id":%s,"worker_id":%s,"n_seqs":%d,"version":%d}'
            % (seq, group_id_json, worker_id_json, n_seqs, version))


def encode_record(head: dict[str, Any], body: bytes) -> bytes:
    """One whole record, encoded at once: what :meth:`StagingBuffer.stage` and
    :func:`seal_records` build in pieces (the reference the tests hold them to)."""
    head_bytes = json.dumps(head, separators=(",", ":")).encode()
    crc = zlib.crc32(body, zlib.crc32(head_bytes))
    return HEADER.pack(MAGIC, crc, len(head_bytes), len(body)) + head_bytes + body


def records_bytes(heads: list[bytes], bodies: list[bytes]) -> int:
    """The size of the records with these heads and bodies."""
    return sum(map(len, heads)) + sum(map(len, bodies)) + HEADER.size * len(heads)


def seal_records(buffer: mmap.mmap | bytearray, start: int, end: int) -> None:
    """Fill in the checksums of the records laid out in ``buffer[start:end]``."""
    view = memoryview(buffer)
    try:
        pos = start
        while pos < end:
            magic, _crc, head_len, body_len = HEADER.unpack_from(buffer, pos)
            record_end = pos + HEADER.size + head_len + body_len
            if magic != MAGIC or record_end > end:
                raise ValueError(f"no whole record at byte {pos} of the staging buffer")
            CRC.pack_into(buffer, pos + 4, zlib.crc32(view[pos + HEADER.size:record_end]))
            pos = record_end
    finally:
        view.release()


class StagingBuffer:
    """Memory shared with the syncer process (a memfd it inherits) where a commit's records are
    laid out: a copy in memory instead of a write to the file on the event loop. Grows to fit
    the biggest commit; pages once touched stay mapped in both processes."""

    def __init__(self, nbytes: int) -> None:
        self.fd = os.memfd_create("slurm-elastic-commit", os.MFD_CLOEXEC)
        self.nbytes = 0
        self.map: mmap.mmap | None = None
        self.reserve(nbytes)

    def reserve(self, nbytes: int) -> mmap.mmap:
        """The buffer, at least ``nbytes`` long (grown in powers of two)."""
        if nbytes > self.nbytes:
            size = max(1 << max(0, nbytes - 1).bit_length(), mmap.PAGESIZE)
            os.ftruncate(self.fd, size)
            if self.map is not None:
                self.map.close()
            self.map, self.nbytes = mmap.mmap(self.fd, size), size
        assert self.map is not None
        return self.map

    def stage(self, heads: list[bytes], bodies: list[bytes], lead: int = 0) -> tuple[int, list[int]]:
        """Lay the records (checksums blank) out from byte ``lead`` (where the commit starts
        within its first block), with room up to the next block boundary after them: their
        size in bytes and where each body starts, counted from the first record."""
        nbytes = records_bytes(heads, bodies)
        buffer = self.reserve(block_end(lead + nbytes))
        offsets = []
        pos = lead
        pack_header = HEADER.pack_into
        for head, body in zip(heads, bodies, strict=True):
            pack_header(buffer, pos, MAGIC, 0, len(head), len(body))
            pos += HEADER.size
            buffer[pos:pos + len(head)] = head
            pos += len(head)
            buffer[pos:pos + len(body)] = body
            offsets.append(pos - lead)
            pos += len(body)
        return nbytes, offsets

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
        os.close(self.fd)


class DamagedRecordError(StateFileError):
    """A group's record in the log is missing, cut short, overwritten or fails its checksum."""


@dataclass(frozen=True)
class ScannedRecord:
    head: dict[str, Any]
    body_offset: int
    body_bytes: int
    end: int  # offset just past the record


def scan(path: Path, start: int = 0) -> tuple[list[ScannedRecord], int]:
    """The whole records in ``path`` from ``start``, and the offset where whole records end."""
    records: list[ScannedRecord] = []
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    pos = 0
    while pos + HEADER.size <= len(data):
        magic, crc, head_len, body_len = HEADER.unpack_from(data, pos)
        head_at = pos + HEADER.size
        end = head_at + head_len + body_len
        if magic != MAGIC or end > len(data):
            break
        head_bytes, body = data[head_at:head_at + head_len], memoryview(data)[head_at + head_len:end]
        if zlib.crc32(body, zlib.crc32(head_bytes)) != crc:
            break
        try:
            head = json.loads(head_bytes)
        except ValueError:
            break
        records.append(ScannedRecord(head, start + head_at + head_len, body_len, start + end))
        pos = end
    return records, start + pos


def is_padding(path: Path, end: int) -> bool:
    """Whether ``path`` holds only zeros from ``end`` to the next block boundary, where it ends:
    what a direct write leaves after a segment's last record."""
    with open(path, "rb") as f:
        f.seek(end)
        rest = f.read(BLOCK_BYTES)
    return end + len(rest) == block_end(end) and not rest.strip(b"\0")


def find_whole_records(data: bytes) -> Iterator[tuple[bytes, int, int]]:
    """Every whole record in ``data`` whose CRC holds, wherever it starts (past damage, the
    search goes on at the next magic): (head, body offset, body size)."""
    pos = data.find(MAGIC)
    while pos >= 0 and pos + HEADER.size <= len(data):
        _magic, crc, head_len, body_len = HEADER.unpack_from(data, pos)
        head_at = pos + HEADER.size
        end = head_at + head_len + body_len
        if end <= len(data) and zlib.crc32(memoryview(data)[head_at + head_len:end],
                                           zlib.crc32(data[head_at:head_at + head_len])) == crc:
            yield data[head_at:head_at + head_len], head_at + head_len, body_len
            pos = data.find(MAGIC, end)
        else:
            pos = data.find(MAGIC, pos + 1)


def segment_numbers(directory: Path) -> list[int]:
    """The segment numbers in ``directory``, oldest first (none if it does not exist): files
    named as :func:`segment_name` names them, others left alone (``1.log`` is not segment 1).
    StateFileError, naming it, for a segment that is not a regular file (a directory or a FIFO
    in its place: reading a FIFO would wait forever)."""
    numbers = []
    for path in directory.glob("*.log"):
        if not (path.stem.isascii() and path.stem.isdigit() and path.name == segment_name(int(path.stem))):
            continue
        if not path.is_file():
            raise StateFileError(
                f"rollout store segment {path} is not a regular file, so the records it held cannot be read; "
                f"restore it from a copy, or move it aside to give up the groups it held")
        numbers.append(int(path.stem))
    return sorted(numbers)


def scan_from(directory: Path, numbers: list[int], number: int,
              offset: int) -> Iterator[tuple[int, list[ScannedRecord], int, int]]:
    """:func:`scan` of each of ``numbers`` from (``number``, ``offset``) on that holds bytes
    there: (segment, whole records, where they end, the segment's size)."""
    for n in [x for x in numbers if x >= number]:
        path = directory / segment_name(n)
        start, size = (offset if n == number else 0), path.stat().st_size
        if start >= size:  # nothing past the index (a segment shorter than the index says is
            continue  # damage to indexed records: found when they are checked, never refilled)
        records, end = scan(path, start)
        yield n, records, end, size


def refuse_damage(path: Path, end: int, size: int) -> None:
    """StateFileError if ``path``, an older segment, holds more than padding after its whole
    records end at ``end``: damage, not a torn write (only the newest segment is written to)."""
    if end != size and not is_padding(path, end):
        raise StateFileError(f"payload log segment {path} is damaged at byte {end}")


class SegmentLog:
    """Places commits in the newest segment (the syncer writes them there), reads bodies back by
    position, deletes segments nobody needs. Thread-safe for reads; places come from one place."""

    def __init__(self, directory: Path, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        try:
            directory.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise StateFileError(f"payload log {directory}: {exc}") from None
        numbers = self.numbers()
        self.current = numbers[-1] if numbers else 1
        self._fd = self._create(self.current)
        self.size = os.fstat(self._fd).st_size
        self._readers: dict[int, int] = {}

    def numbers(self) -> list[int]:
        """The segment numbers on disk, oldest first."""
        return segment_numbers(self.directory)

    def path(self, number: int) -> Path:
        return self.directory / segment_name(number)

    def _create(self, number: int) -> int:
        """Open segment ``number``, created if new (held to cut a failed commit off)."""
        return os.open(self.path(number), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def place(self, nbytes: int) -> tuple[int, int]:
        """Room for a commit of ``nbytes`` in the newest segment, rolling over first if it is
        full: (segment, offset). The syncer writes it there; until it says so, nothing is durable."""
        if self.size >= self.segment_bytes:
            self.roll_over()
        start = self.size
        self.size += nbytes
        return self.current, start

    def truncate(self, size: int) -> None:
        """Undo a commit nobody was answered for (durably: a power cut must not bring it back
        once the log has moved on to another segment)."""
        os.ftruncate(self._fd, size)
        os.fsync(self._fd)
        self.size = size

    def roll_over(self) -> None:
        """Append to a new segment from now on."""
        fd = self._create(self.current + 1)
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)  # the new file's name is durable before any record in it is acknowledged
        finally:
            os.close(dir_fd)
        os.close(self._fd)
        self._fd, self.current, self.size = fd, self.current + 1, 0

    def read_checked(self, number: int, body_offset: int, nbytes: int, head: bytes) -> bytes:
        """The body of the record with this ``head`` whose body the index puts at
        ``body_offset``: read with its header and head, and returned only if the header names
        this head and size and the checksum holds (else DamagedRecordError)."""
        name = segment_name(number)
        fd = self._readers.get(number)
        if fd is None:
            try:
                fd = self._readers[number] = os.open(self.path(number),
                                                     os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO: no wait
            except FileNotFoundError:
                raise DamagedRecordError(f"segment {name} is missing") from None
        start = body_offset - len(head) - HEADER.size
        prefix = os.pread(fd, HEADER.size + len(head), start) if start >= 0 else b""
        body = os.pread(fd, nbytes, body_offset)  # read apart: the body is returned uncopied
        if len(prefix) != HEADER.size + len(head) or len(body) != nbytes:
            raise DamagedRecordError(f"segment {name} ends before the record at byte {start} does")
        magic, crc, head_len, body_len = HEADER.unpack_from(prefix)
        if magic != MAGIC or head_len != len(head) or body_len != nbytes or prefix[HEADER.size:] != head:
            raise DamagedRecordError(f"the record at byte {start} of segment {name} is not this group's")
        if zlib.crc32(body, zlib.crc32(head)) != crc:
            raise DamagedRecordError(f"checksum mismatch in the record at byte {start} of segment {name}")
        return body

    def delete(self, number: int) -> None:
        """Remove a segment no queued or handed group needs (never the one being appended to)."""
        if number == self.current:
            return
        fd = self._readers.pop(number, None)
        if fd is not None:
            os.close(fd)
        self.path(number).unlink(missing_ok=True)

    def records_after(self, number: int, offset: int) -> Iterator[tuple[int, ScannedRecord]]:
        """Every whole record from (segment, offset) on, in order; cuts a torn tail off the newest
        segment. A bad record in an older segment is damage, not a torn write: StateFileError
        (found before, read-only, by :func:`torn.refuse_damaged_log`, as are other bytes than a torn
        write at the newest one's end)."""
        for n, records, end, size in scan_from(self.directory, self.numbers(), number, offset):
            yield from ((n, r) for r in records)
            if n != self.current:
                refuse_damage(self.path(n), end, size)
            elif end != size:
                self._say_cut(n, end, size)
                self.truncate(end)

    def _say_cut(self, number: int, end: int, size: int) -> None:
        """Log the torn tail about to be cut off the newest segment, and any whole records past
        its hole: groups written after a commit a power cut tore (``fsync`` "os" or "off"), lost."""
        with open(self.path(number), "rb") as f:
            f.seek(end)
            past = sum(1 for _ in find_whole_records(f.read()))
        log.warning("payload log segment %s: cutting %d byte(s) from byte %d, a write cut short%s",
                    segment_name(number), size - end, end,
                    f"; {past} whole record(s) past it are cut with it (a power cut with fsync 'os' or 'off' "
                    "tore an earlier commit: those groups are lost)" if past else "")

    def close(self) -> None:
        for fd in [self._fd, *self._readers.values()]:
            os.close(fd)
        self._readers.clear()
