"""The rollout store's syncer: a small process that makes each group commit durable.

The controller appends a commit's records to the payload log and sends one line here::

    {"segment": N, "rows": [[seq, id, worker_id, n_seqs, version, nbytes, body_offset], ...]}

This process fdatasyncs segment N (with ``fsync = "always"``), then indexes the rows in the
database in one transaction (a row whose id is stored already is skipped), and answers one
line: ``{"ignored": [seq, ...]}`` or ``{"error": "..."}``. It runs as its own process so that
the wait for the disk and the index write hold no lock the controller's event loop needs: in a
thread they would take turns with the loop for the interpreter lock. It exits when the
controller closes its input (or dies). Standard library only; started with ``python -I``.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from typing import Any

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


def main(argv: list[str]) -> int:
    db_path, segment_dir, fsync = argv
    db = sqlite3.connect(db_path, isolation_level=None, cached_statements=ROWS_PER_STATEMENT + 16)
    db.execute("PRAGMA busy_timeout=30000")
    db.execute(f"PRAGMA synchronous={'OFF' if fsync == 'off' else 'NORMAL'}")  # the log is what is fsynced
    open_segment, fd = -1, -1
    for line in sys.stdin.buffer:
        try:
            message = json.loads(line)
            segment = int(message["segment"])
            if segment != open_segment:
                if fd >= 0:
                    os.close(fd)
                fd = os.open(os.path.join(segment_dir, f"{segment:08d}.log"), os.O_RDONLY)
                open_segment = segment
            if fsync == "always":
                os.fdatasync(fd)
            reply: dict[str, object] = {"ignored": index_rows(db, segment, message["rows"])}
        except Exception as exc:  # answered, so the controller fails this commit and nothing else
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.buffer.write(json.dumps(reply).encode() + b"\n")
        sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
