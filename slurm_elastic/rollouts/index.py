"""The rollout store's index: one row per group in SQLite (WAL mode), beside the payload log.

A row says who sent the group, its size and version, its state (queued -> handed -> delivered,
or dropped as too stale, or lost: its record in the log was damaged) and where its body is in
the log. Batches and their acknowledgements, lost groups (why, when) and a few settings
(``meta``) live here too. Every method is one transaction under the store's lock; SQLite and
OS errors come out as :class:`StoreUnavailableError` (the disk is full or failing: try again).
Before the index is opened for writing it is checked read-only (:mod:`inspection`).
"""

from __future__ import annotations

import collections
import logging
import shutil
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NamedTuple

from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.mark import MarkWriter
from slurm_elastic.rollouts.storage import LostGroup, StoredGroup, StoreUnavailableError

log = logging.getLogger(__name__)
SYNCHRONOUS = {"always": "FULL", "os": "NORMAL", "off": "OFF"}
SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    worker_id TEXT NOT NULL,
    n_seqs INTEGER NOT NULL,
    version INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    payload BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'queued',
    batch_id TEXT,
    segment INTEGER,
    body_offset INTEGER
);
CREATE INDEX IF NOT EXISTS groups_state ON groups(state, seq);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    created_s REAL NOT NULL,
    acked INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lost (
    id TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    lost_s REAL NOT NULL
);
"""
LIVE_STATES = "('queued', 'handed')"
STALENESS_KEY = "staleness"  # the meta key of the queue's staleness counts
TRAINER_SESSION_KEY = "trainer_session"  # ... and of the newest trainer registration's session
LOST_TOLD_KEY = "lost_told"  # ... and of how many lost groups (oldest first) an acknowledged batch named
SET_META = "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value"
UNKNOWN_LOSS = "quarantined earlier; why and when were lost with the index's lost table"
TRANSITIONS_KEY = "transitions"  # ... and of the hand-outs, acks, drops and quarantines committed (mark.py)
MARKER_KEY = "store"  # a meta row written when the index is opened: meta rows without it were lost
STATES = "('queued', 'handed', 'delivered', 'dropped', 'lost')"
NOT_WRITTEN_HERE = f"""state NOT IN {STATES}
    OR state IN {LIVE_STATES} AND (typeof(id) != 'text' OR typeof(worker_id) != 'text'
        OR typeof(n_seqs) != 'integer' OR n_seqs < 1 OR typeof(version) != 'integer' OR version < 0
        OR typeof(nbytes) != 'integer' OR typeof(segment) != 'integer' OR typeof(body_offset) != 'integer')
    OR state = 'handed' AND (batch_id IS NULL OR batch_id NOT IN (SELECT id FROM batches WHERE acked = 0))"""
"""Rows this version never writes: in no known state, a live row (queued or handed) with a value of
another type or out of range, or handed in no open batch (it would never be delivered)."""
ROW = "seq, id, worker_id, n_seqs, version, nbytes"
WHERE_BODY = "segment, body_offset"


class GroupBody(NamedTuple):
    """A group and where its body is in the log."""

    group: StoredGroup
    segment: int
    body_offset: int


FULL_DISK_FREE_BYTES = 1 << 20  # less free space than this beside a store that fails to open: say the disk is full


def disk_full_hint(path: Path) -> str:
    """"; the disk holding it is full (...)" when the file system of ``path`` has (almost) no
    space left: SQLite says only "disk I/O error" when it cannot write its -wal or -shm file."""
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return ""
    if free >= FULL_DISK_FREE_BYTES:
        return ""
    return f"; the disk holding it is full ({free} bytes free on {path.parent}): free space and start again"


class StoreIndex:
    """The SQLite side of the store. Thread-safe: one connection behind a lock."""

    def __init__(self, path: Path, fsync: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.transitions = 0  # what the index has committed: read by create_schema
        self._mark = MarkWriter(path, fsync=fsync == "always")
        self._mark_failing = False
        try:
            self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute(f"PRAGMA synchronous={SYNCHRONOUS[fsync]}")
            self.db.execute("PRAGMA busy_timeout=30000")  # the syncer writes index rows too
        except sqlite3.DatabaseError as exc:
            raise StateFileError(f"rollout store {path} is unusable: {exc}{disk_full_hint(path)}") from None

    def create_schema(self, now_s: float, transitions: int) -> int:
        """The tables, made if missing (the index was checked by :func:`inspection.inspect_index`
        first, which counted its ``transitions``). Lost groups whose ``lost`` row is gone (the table
        was dropped or emptied) get one back, dated ``now_s``, saying their reason was lost:
        returns how many."""
        self.transitions = transitions
        try:
            self.db.executescript(SCHEMA)
            self.db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, 'slurm-elastic rollout store')",
                            (MARKER_KEY,))
            return self.db.execute(
                "INSERT INTO lost (id, reason, lost_s) SELECT id, ?, ? FROM groups "
                "WHERE state = 'lost' AND id NOT IN (SELECT id FROM lost)", (UNKNOWN_LOSS, now_s)).rowcount
        except sqlite3.DatabaseError as exc:
            raise StateFileError(f"rollout store {self.path} is unusable: {exc}") from None

    @contextmanager
    def transaction(self, transition: bool = False) -> Iterator[sqlite3.Connection]:
        """One write transaction (lock held); rolled back whole on any error. A ``transition``
        (groups change state) is counted in the same transaction, then in the mark."""
        with self.lock:
            try:
                self.db.execute("BEGIN IMMEDIATE")
                if transition:
                    self.db.execute(SET_META, (TRANSITIONS_KEY, str(self.transitions + 1)))
                yield self.db
                self.db.execute("COMMIT")
            except (sqlite3.Error, OSError) as exc:
                self._rollback()
                raise StoreUnavailableError(f"rollout store {self.path}: {exc}") from None
            except BaseException:
                self._rollback()
                raise
            if transition:
                self.transitions += 1
                self._write_mark()

    def _write_mark(self) -> None:
        """The committed count to the mark (lock held). A failure is logged once until a write
        succeeds again, and changes nothing else: the mark lagging the index is allowed."""
        try:
            self._mark.write(self.transitions)
        except OSError as exc:
            if not self._mark_failing:
                log.warning("rollout store %s: writing its mark failed (%s); an index restored from an older "
                            "copy would not be detected until it is written again", self.path, exc)
            self._mark_failing = True
            return
        self._mark_failing = False

    def reset_mark(self) -> None:
        """A new index: its mark starts again at what it counts."""
        with self.lock:
            self._write_mark()

    @contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        """One read (lock held); SQLite's errors come out as :class:`StoreUnavailableError`."""
        with self.lock:
            try:
                yield self.db
            except sqlite3.Error as exc:
                raise StoreUnavailableError(f"rollout store {self.path}: {exc}") from None

    def _rollback(self) -> None:
        if self.db.in_transaction:  # SQLite may have rolled back already (disk full)
            with suppress(sqlite3.Error):
                self.db.execute("ROLLBACK")

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # ---- reads ------------------------------------------------------------------------------
    def last_row(self) -> tuple[int, int | None, int | None, int] | None:
        """The newest row's arrival number, segment, body offset and size."""
        with self.reading() as db:
            row = db.execute(
                "SELECT seq, segment, body_offset, nbytes FROM groups ORDER BY seq DESC LIMIT 1").fetchone()
        return None if row is None else (int(row[0]), row[1], row[2], int(row[3]))

    def live_per_segment(self) -> dict[int, int]:
        with self.reading() as db:
            return dict(db.execute(f"SELECT segment, COUNT(*) FROM groups WHERE state IN {LIVE_STATES} "
                                        "GROUP BY segment"))

    def lost_segments(self) -> set[int]:
        """The segments that hold a group quarantined as lost."""
        with self.reading() as db:
            return {int(r[0]) for r in db.execute(
                "SELECT DISTINCT segment FROM groups WHERE state='lost' AND segment IS NOT NULL")}

    def live_bodies(self) -> list[GroupBody]:
        """Every queued or handed group's body location, in arrival order (to verify at open)."""
        with self.reading() as db:
            rows = list(db.execute(f"SELECT {ROW}, {WHERE_BODY} FROM groups "
                                        f"WHERE state IN {LIVE_STATES} ORDER BY seq"))
        return [_body(r) for r in rows]

    def bodies(self, group_ids: list[str]) -> list[GroupBody]:
        with self.reading() as db:
            rows = {r[1]: r for r in db.execute(
                f"SELECT {ROW}, {WHERE_BODY} FROM groups WHERE id IN ({','.join('?' * len(group_ids))})",
                group_ids)}
        return [_body(rows[g]) for g in group_ids]

    def known(self, group_id: str) -> bool:
        """A group of this id was stored, in any state."""
        with self.reading() as db:
            return db.execute("SELECT 1 FROM groups WHERE id = ?", (group_id,)).fetchone() is not None

    def batch_bodies(self, batch_id: str) -> list[GroupBody]:
        """A batch's groups (lost and dropped ones left out), in arrival order."""
        with self.reading() as db:
            rows = list(db.execute(f"SELECT {ROW}, {WHERE_BODY} FROM groups "
                                        "WHERE batch_id=? AND state NOT IN ('lost', 'dropped') ORDER BY seq",
                                   (batch_id,)))
        return [_body(r) for r in rows]

    def queued(self) -> list[StoredGroup]:
        with self.reading() as db:
            rows = db.execute(f"SELECT {ROW} FROM groups WHERE state='queued' ORDER BY seq")
            return [StoredGroup(*r) for r in rows]

    def unacked_batches(self) -> list[tuple[str, list[StoredGroup]]]:
        with self.reading() as db:
            batches = [r[0] for r in db.execute("SELECT id FROM batches WHERE acked=0 ORDER BY created_s, rowid")]
            out = []
            for batch_id in batches:
                rows = db.execute(f"SELECT {ROW} FROM groups WHERE batch_id=? AND state NOT IN ('lost', 'dropped') "
                                       "ORDER BY seq", (batch_id,))
                out.append((batch_id, [StoredGroup(*r) for r in rows]))
            return out

    def counts(self) -> dict[str, int]:
        with self.reading() as db:
            return {state: int(n) for state, n in
                    db.execute("SELECT state, COALESCE(SUM(n_seqs), 0) FROM groups GROUP BY state")}

    def lost(self) -> list[LostGroup]:
        with self.reading() as db:
            rows = db.execute("SELECT g.id, g.worker_id, g.n_seqs, g.version, g.batch_id, l.reason, l.lost_s "
                                   "FROM lost l JOIN groups g ON g.id = l.id ORDER BY l.lost_s, g.seq")
            return [LostGroup(*r) for r in rows]

    def stored_seqs(self, first: int, last: int) -> set[int]:
        with self.reading() as db:
            return {int(r[0]) for r in db.execute("SELECT seq FROM groups WHERE seq BETWEEN ? AND ?",
                                                       (first, last))}

    def arrived_since(self, seq: int) -> tuple[int, dict[str, int]]:
        with self.reading() as db:
            last = db.execute("SELECT COALESCE(MAX(seq), 0) FROM groups").fetchone()[0]
            rows = db.execute("SELECT worker_id, SUM(n_seqs) FROM groups WHERE seq > ? GROUP BY worker_id",
                                   (seq,))
            return int(last), {str(w): int(n) for w, n in rows}

    def get_meta(self, key: str, default: str) -> str:
        with self.reading() as db:
            row = db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
            return str(row[0]) if row else default

    # ---- writes (each one transaction) ------------------------------------------------------
    def insert_recovered(self, rows: Sequence[tuple[object, ...]], sql: str) -> None:
        with self.transaction() as db:
            for row in rows:
                db.execute(sql, row)

    def hand_out(self, batch_id: str, group_ids: list[str], now_s: float) -> None:
        with self.transaction(transition=True) as db:
            db.execute("INSERT INTO batches (id, created_s) VALUES (?, ?)", (batch_id, now_s))
            db.executemany("UPDATE groups SET state='handed', batch_id=? WHERE id=?",
                           [(batch_id, g) for g in group_ids])

    def ack(self, batch_id: str) -> tuple[bool | None, list[tuple[int, int]]]:
        """Mark a batch delivered: (None: unknown batch, False: acknowledged already, True) and
        the groups it frees per segment."""
        with self.transaction(transition=True) as db:
            row = db.execute("SELECT acked FROM batches WHERE id=?", (batch_id,)).fetchone()
            if row is None or row[0]:
                return (None if row is None else False), []
            db.execute("UPDATE batches SET acked=1 WHERE id=?", (batch_id,))
            freed = list(db.execute("SELECT segment, COUNT(*) FROM groups WHERE batch_id=? AND state='handed' "
                                    "GROUP BY segment", (batch_id,)))
            db.execute("UPDATE groups SET state='delivered' WHERE batch_id=? AND state='handed'",
                       (batch_id,))
        return True, freed

    def drop(self, group_ids: Iterable[str]) -> list[tuple[int, int]]:
        ids = list(group_ids)
        with self.transaction(transition=True) as db:
            freed = list(db.execute(
                f"SELECT segment, COUNT(*) FROM groups WHERE id IN ({','.join('?' * len(ids))}) "
                f"AND state IN {LIVE_STATES} GROUP BY segment", ids))
            db.executemany("UPDATE groups SET state='dropped' WHERE id=?", [(g,) for g in ids])
        return freed

    def quarantine(self, damaged: list[tuple[GroupBody, str]], now_s: float) -> list[tuple[int, int]]:
        """Record groups as lost (their rows stay, state ``lost``, the reason in ``lost``)."""
        with self.transaction(transition=True) as db:
            db.executemany("INSERT OR IGNORE INTO lost (id, reason, lost_s) VALUES (?, ?, ?)",
                           [(b.group.id, reason, now_s) for b, reason in damaged])
            db.executemany("UPDATE groups SET state='lost' WHERE id=?",
                           [(b.group.id,) for b, _r in damaged])
        return list(collections.Counter(b.segment for b, _r in damaged).items())

    def move(self, moves: dict[int, tuple[int, int]]) -> None:
        """Rows whose record was found at another place (:mod:`placement`) point there now."""
        with self.transaction() as db:
            db.executemany("UPDATE groups SET segment=?, body_offset=? WHERE seq=?",
                           [(segment, offset, seq) for seq, (segment, offset) in moves.items()])

    def set_meta(self, key: str, value: str, transition: bool = False) -> None:
        """Set one meta value; a ``transition`` is counted (and marked) as hand-outs are."""
        with self.transaction(transition) as db:
            db.execute(SET_META, (key, value))


def _body(row: Any) -> GroupBody:
    """A row of ``ROW, WHERE_BODY``."""
    return GroupBody(StoredGroup(*row[:6]), row[6], row[7])
