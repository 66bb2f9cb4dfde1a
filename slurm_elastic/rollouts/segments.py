"""The payload log: rollout group bodies appended to segment files in the job's state directory.

A record is a fixed header, a small JSON head naming the group and its arrival number, and the
group's body exactly as the worker sent it::

    magic b"SER1" | crc32(head + body) u32 | head length u32 | body length u32 | head | body

The controller appends a commit's records with one write; the syncer process makes them
durable (fdatasync) before anyone is answered. Segments roll over at ``segment_bytes`` and are
deleted once no group in them is waiting or handed out. After a crash the records past what
the database knows are read back (:func:`scan`); a torn record can only be the last segment's
tail, from a commit nobody was answered for, and is cut off.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_elastic.errors import StateFileError

MAGIC = b"SER1"
HEADER = struct.Struct("<4sIII")
SEGMENT_BYTES = 64 * 1024 * 1024
IOV_MAX = 1024  # buffers per writev


def segment_name(number: int) -> str:
    return f"{number:08d}.log"


def json_str(text: str) -> bytes:
    """``text`` as a JSON string."""
    return json.dumps(text).encode()


def group_head(seq: int, group_id_json: bytes, worker_id_json: bytes, n_seqs: int, version: int) -> bytes:
    """A group record's head (ids given as :func:`json_str`): the JSON ``json.dumps(...,
    separators=(",", ":"))`` would write, at a fraction of its cost (it is built per submit)."""
    return (b'{"seq":%d,"id":%s,"worker_id":%s,"n_seqs":%d,"version":%d}'
            % (seq, group_id_json, worker_id_json, n_seqs, version))


def record_prefix(head: dict[str, Any] | bytes, body: bytes) -> bytes:
    """A record without its body: header and head (the body is written as it came, uncopied)."""
    head_bytes = head if isinstance(head, bytes) else json.dumps(head, separators=(",", ":")).encode()
    crc = zlib.crc32(body, zlib.crc32(head_bytes))
    return HEADER.pack(MAGIC, crc, len(head_bytes), len(body)) + head_bytes


def encode_record(head: dict[str, Any], body: bytes) -> bytes:
    return record_prefix(head, body) + body


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


class SegmentLog:
    """Appends commits to the newest segment (one writer: the controller), reads bodies back by
    position, deletes segments nobody needs. Thread-safe for reads; appends come from one place."""

    def __init__(self, directory: Path, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        try:
            directory.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise StateFileError(f"payload log {directory}: {exc}") from None
        numbers = self.numbers()
        self.current = numbers[-1] if numbers else 1
        self._fd = self._open_for_append(self.current)
        self.size = os.fstat(self._fd).st_size
        self._readers: dict[int, int] = {}

    def numbers(self) -> list[int]:
        """The segment numbers on disk, oldest first."""
        return sorted(int(p.stem) for p in self.directory.glob("*.log") if p.stem.isdigit())

    def path(self, number: int) -> Path:
        return self.directory / segment_name(number)

    def _open_for_append(self, number: int) -> int:
        return os.open(self.path(number), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)

    def append(self, parts: list[bytes]) -> tuple[int, int]:
        """Write one commit's records (their parts, in order) to the newest segment, rolling over
        first if it is full; returns (segment, offset of the first record). Not durable until the
        syncer says so."""
        if self.size >= self.segment_bytes:
            self._roll_over()
        start = self.size
        want = sum(map(len, parts))
        written = 0
        try:
            for i in range(0, len(parts), IOV_MAX):
                written += os.writev(self._fd, parts[i:i + IOV_MAX])
        except OSError as exc:
            self.truncate(start)
            raise StateFileError(f"payload log {self.path(self.current)}: {exc}") from None
        if written != want:
            self.truncate(start)
            raise StateFileError(f"payload log {self.path(self.current)}: short write (disk full?)")
        self.size += written
        return self.current, start

    def truncate(self, size: int) -> None:
        """Undo a commit nobody was answered for."""
        os.ftruncate(self._fd, size)
        self.size = size

    def _roll_over(self) -> None:
        os.close(self._fd)
        self.current += 1
        self._fd = self._open_for_append(self.current)
        self.size = 0
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)  # the new file's name is durable before any record in it is acknowledged
        finally:
            os.close(dir_fd)

    def read(self, number: int, offset: int, nbytes: int) -> bytes:
        fd = self._readers.get(number)
        if fd is None:
            try:
                fd = self._readers[number] = os.open(self.path(number), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise StateFileError(f"payload log segment {self.path(number)} is missing") from None
        data = os.pread(fd, nbytes, offset)
        if len(data) != nbytes:
            raise StateFileError(f"payload log segment {self.path(number)} is shorter than its index says")
        return data

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
        segment. A bad record in an older segment is damage, not a torn write: StateFileError."""
        for n in [x for x in self.numbers() if x >= number]:
            records, end = scan(self.path(n), offset if n == number else 0)
            yield from ((n, r) for r in records)
            if end != self.path(n).stat().st_size:
                if n != self.current:
                    raise StateFileError(f"payload log segment {self.path(n)} is damaged at byte {end}")
                self.truncate(end)

    def close(self) -> None:
        for fd in [self._fd, *self._readers.values()]:
            os.close(fd)
        self._readers.clear()
