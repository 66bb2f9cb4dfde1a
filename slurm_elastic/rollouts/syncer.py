"""The rollout store's syncer: a small process that makes each group commit durable.

The controller lays a commit's records out in the staging buffer (memory both processes map,
:class:`segments.StagingBuffer`) and sends one line here::

    {"segment": N, "offset": O, "nbytes": B, "rows": [[seq, id, worker_id, n_seqs, version, nbytes, body_offset], ...]}

This process fills in the records' checksums, writes the buffer's first B bytes at offset O of
segment N, fdatasyncs it (with ``fsync = "always"``), then indexes the rows in the database in
one transaction (a row whose id is stored already is skipped), and answers one line:
``{"ignored": [seq, ...]}`` or ``{"error": "..."}``. It runs as its own process so that the
write, the wait for the disk and the index write hold no lock the controller's event loop
needs: in a thread they would take turns with the loop for the interpreter lock. It exits when
the controller closes its input (or dies). Started with ``python -I`` (:data:`COMMAND`): it
imports the standard library and :mod:`segments`, nothing from the environment.
"""

from __future__ import annotations

import json
import mmap
import os
import sqlite3
import sys
from typing import Any

from slurm_elastic.rollouts.segments import seal_records

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


def main(argv: list[str]) -> int:
    db_path, segment_dir, fsync, staging_fd = argv[0], argv[1], argv[2], int(argv[3])
    db = sqlite3.connect(db_path, isolation_level=None, cached_statements=ROWS_PER_STATEMENT + 16)
    db.execute("PRAGMA busy_timeout=30000")
    db.execute(f"PRAGMA synchronous={'OFF' if fsync == 'off' else 'NORMAL'}")  # the log is what is fsynced
    staging: mmap.mmap | None = None
    open_segment, fd = -1, -1
    for line in sys.stdin.buffer:
        try:
            message = json.loads(line)
            segment, offset, nbytes = int(message["segment"]), int(message["offset"]), int(message["nbytes"])
            if staging is None or len(staging) < nbytes:  # the controller grew it
                if staging is not None:
                    staging.close()
                staging = mmap.mmap(staging_fd, os.fstat(staging_fd).st_size)
            if segment != open_segment:
                if fd >= 0:
                    os.close(fd)
                fd = os.open(os.path.join(segment_dir, f"{segment:08d}.log"), os.O_WRONLY)
                open_segment = segment
            seal_records(staging, nbytes)
            with memoryview(staging) as view:
                write_all(fd, view[:nbytes], offset)
            if fsync == "always":
                os.fdatasync(fd)
            reply: dict[str, object] = {"ignored": index_rows(db, segment, message["rows"])}
        except Exception as exc:  # answered, so the controller fails this commit and nothing else
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.buffer.write(json.dumps(reply).encode() + b"\n")
        sys.stdout.buffer.flush()
    return 0
