"""The rollout store's syncer: a small process that makes each group commit durable.

The controller lays a commit's records out in the staging buffer (memory both processes map,
:class:`segments.StagingBuffer`) and sends one line here::

    {"segment": N, "offset": O, "nbytes": B, "rows": [[seq, id, worker_id, n_seqs, version, nbytes, body_offset], ...]}

The records are staged from byte ``O % BLOCK_BYTES`` of the buffer. This process fills in
their checksums, writes them at offset O of segment N (:class:`SegmentWriter`), fdatasyncs it
(with ``fsync = "always"``), then indexes the rows in the database in one transaction (a row
whose id is stored already is skipped), and answers one line:
``{"ignored": [seq, ...]}`` or ``{"error": "..."}``. It runs as its own process so that the
write, the wait for the disk and the index write hold no lock the controller's event loop
needs: in a thread they would take turns with the loop for the interpreter lock. It exits when
the controller closes its input (or dies). Started with ``python -I`` (:data:`COMMAND`): it
imports the standard library and :mod:`segments`, nothing from the environment.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import sqlite3
import sys
from typing import Any

from slurm_elastic.rollouts.segments import BLOCK_BYTES, block_end, seal_records, segment_name

COMMAND = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
           "from slurm_elastic.rollouts.syncer import main; sys.exit(main(sys.argv[1:]))")
"""For ``python -I -c``, followed by the directory holding the package and main()'s arguments."""
ROWS_PER_STATEMENT = 256  # 9 parameters a row, under SQLite's 32,766 per statement
COLUMNS = "seq, id, worker_id, n_seqs, version, nbytes, segment, body_offset, payload"


def insert_rows_sql(n_rows: int) -> str:
    return f"INSERT OR IGNORE INTO groups ({COLUMNS}) VALUES " + ",".join(["(?,?,?,?,?,?,?,?,X'')"] * n_rows)


def index_rows(db: sqlite3.Connection, segment: int, rows: list[list[Any]]) -> list[int]:
    """Insert the rows (one transaction); the arrival numbers skipped as already stored."""
    before = db.total_changes
    chunks = [rows[i:i + ROWS_PER_STATEMENT] for i in range(0, len(rows), ROWS_PER_STATEMENT)]
    if len(chunks) > 1:
        db.execute("BEGIN IMMEDIATE")
    try:
        for chunk in chunks:
            params: list[object] = []
            for row in chunk:
                params.extend(row[:6])
                params.append(segment)
                params.append(row[6])
            db.execute(insert_rows_sql(len(chunk)), params)
        if len(chunks) > 1:
            db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    if db.total_changes - before == len(rows):
        return []
    seqs = [int(r[0]) for r in rows]
    stored = {int(r[0]) for r in db.execute("SELECT seq FROM groups WHERE seq BETWEEN ? AND ?", (min(seqs), max(seqs)))}
    return [s for s in seqs if s not in stored]


def write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


ZEROS = bytes(BLOCK_BYTES)


class SegmentWriter:
    """Writes staged commits to their segment. Direct (O_DIRECT) when asked (the store asks when
    it fsyncs the log) and the filesystem allows it: no copy into the page cache, and the
    fdatasync that follows finds no dirty pages to write (docs/queue.md has the measurements).
    A direct write covers whole blocks, so the bytes of the
    commit's first block already on disk (kept from the last commit, or read back) are put in
    front of its records and zeros after them; rewriting those bytes with the same values
    cannot tear them. Otherwise, or once the filesystem refuses (EINVAL), through the page
    cache. ``sync_left``: fdatasync a segment when the writes move on to the next (with
    ``fsync = "os"``, whose commits are not synced one by one: a power cut within the page
    cache's writeback could otherwise tear an older segment, which the store refuses to open)."""

    def __init__(self, segment_dir: str, direct: bool, sync_left: bool = False) -> None:
        self.segment_dir = segment_dir
        self.direct = direct
        self.sync_left = sync_left
        self.number, self.fd = -1, -1
        self.tail, self.tail_end = b"", -1  # the segment's bytes in its last block, and where they end

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.number, self.fd, self.tail_end = -1, -1, -1

    def _open(self, number: int) -> None:
        self.close()
        path = os.path.join(self.segment_dir, segment_name(number))
        if self.direct:
            try:
                self.fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # this filesystem has no direct I/O
        if self.fd < 0:
            self.fd = os.open(path, os.O_WRONLY)
        self.number = number

    def write(self, staging: mmap.mmap, number: int, offset: int, nbytes: int) -> None:
        """Write the ``nbytes`` of records staged from byte ``offset % BLOCK_BYTES`` of
        ``staging`` at ``offset`` of segment ``number``."""
        if number != self.number:
            if self.sync_left and self.fd >= 0:
                os.fdatasync(self.fd)  # once per segment (64 MiB): the one left is whole on disk
            self._open(number)
        lead = offset % BLOCK_BYTES
        if self.direct:
            try:
                self._write_direct(staging, offset, lead, nbytes)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # the filesystem takes no direct write of this shape
                self._open(number)
        with memoryview(staging) as view:
            write_all(self.fd, view[lead:lead + nbytes], offset)

    def _write_direct(self, staging: mmap.mmap, offset: int, lead: int, nbytes: int) -> None:
        if self.tail_end != offset:
            self.tail = self._read_back(offset - lead, lead) if lead else b""
        end = lead + nbytes
        aligned = block_end(end)
        staging[:lead] = self.tail
        staging[end:aligned] = ZEROS[:aligned - end]
        with memoryview(staging) as view:
            write_all(self.fd, view[:aligned], offset - lead)
        self.tail, self.tail_end = staging[end - (offset + nbytes) % BLOCK_BYTES:end], offset + nbytes

    def _read_back(self, at: int, nbytes: int) -> bytes:
        with open(os.path.join(self.segment_dir, segment_name(self.number)), "rb") as f:
            f.seek(at)
            data = f.read(nbytes)
        if len(data) != nbytes:
            raise OSError(errno.EIO, f"segment {self.number} is shorter than {at + nbytes} bytes")
        return data


def main(argv: list[str]) -> int:
    db_path, segment_dir, fsync, staging_fd, io = argv[0], argv[1], argv[2], int(argv[3]), argv[4]
    db = sqlite3.connect(db_path, isolation_level=None, cached_statements=ROWS_PER_STATEMENT + 16)
    db.execute("PRAGMA busy_timeout=30000")
    db.execute(f"PRAGMA synchronous={'OFF' if fsync == 'off' else 'NORMAL'}")  # the log is what is fsynced
    staging: mmap.mmap | None = None
    writer = SegmentWriter(segment_dir, direct=io == "direct", sync_left=fsync == "os")
    for line in sys.stdin.buffer:
        try:
            message = json.loads(line)
            segment, offset, nbytes = int(message["segment"]), int(message["offset"]), int(message["nbytes"])
            lead = offset % BLOCK_BYTES
            if staging is None or len(staging) < block_end(lead + nbytes):  # the controller grew it
                if staging is not None:
                    staging.close()
                staging = mmap.mmap(staging_fd, os.fstat(staging_fd).st_size)
            seal_records(staging, lead, lead + nbytes)
            writer.write(staging, segment, offset, nbytes)
            if fsync == "always":
                os.fdatasync(writer.fd)
            reply: dict[str, object] = {"ignored": index_rows(db, segment, message["rows"])}
        except Exception as exc:  # answered, so the controller fails this commit and nothing else
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            sys.stdout.buffer.write(json.dumps(reply).encode() + b"\n")
            sys.stdout.buffer.flush()
        except BrokenPipeError:  # the controller is gone (killed): what was written is indexed at its next open
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            return 0
    return 0
