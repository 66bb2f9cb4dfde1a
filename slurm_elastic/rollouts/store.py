"""The durable side of the rollout queue: SQLite in WAL mode in the job's state directory.

A submit is committed (and, with the default ``fsync = "always"``, fsynced) before the API
answers 2xx. Submits go through one writer thread that commits everything waiting in one
transaction (group commit): under concurrency many submits share one fsync, and each caller is
answered only once the transaction holding its group is durable. Groups move queued -> handed (in a batch) -> delivered (the trainer acknowledged
the batch) or dropped (too stale). Batches handed out and never acknowledged are handed out
again, with the same id, after a trainer or controller restart.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from slurm_elastic.errors import StateFileError

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
    batch_id TEXT
);
CREATE INDEX IF NOT EXISTS groups_state ON groups(state, seq);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    created_s REAL NOT NULL,
    acked INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
INSERT_GROUP = "INSERT INTO groups (id, worker_id, n_seqs, version, nbytes, payload) VALUES (?,?,?,?,?,?)"


class StoredGroup(NamedTuple):
    """A queued group's record in memory (a tuple of atoms: the garbage collector skips it)."""

    seq: int
    id: str
    worker_id: str
    n_seqs: int
    version: int
    nbytes: int


@dataclass(frozen=True)
class _PendingInsert:
    row: tuple[str, str, int, int, int, bytes]
    done: Future[int | None]


class RolloutStore:
    """One SQLite database; thread-safe (one connection behind a lock, one writer thread for submits)."""

    def __init__(self, path: Path, fsync: str = "always") -> None:
        if fsync not in SYNCHRONOUS:
            raise ValueError(f"fsync must be one of {', '.join(SYNCHRONOUS)}")
        self.path = path
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={SYNCHRONOUS[fsync]}")
            self._db.executescript(SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise StateFileError(f"rollout store {path} is unusable: {exc}") from None
        self._pending: list[_PendingInsert] = []
        self._pending_changed = threading.Condition()
        self._writer: threading.Thread | None = None
        self._closing = False
        self.commits = 0  # transactions the writer committed (fewer than inserts under concurrency)

    def close(self) -> None:
        """Commit what is waiting, stop the writer, close the database."""
        with self._pending_changed:
            self._closing = True
            self._pending_changed.notify()
            writer = self._writer
        if writer is not None:
            writer.join()
        with self._lock:
            self._db.close()

    def insert(self, group_id: str, worker_id: str, n_seqs: int, version: int, payload: bytes) -> int | None:
        """Commit one group; its arrival number, or None if that id is already stored."""
        return self.insert_later(group_id, worker_id, n_seqs, version, payload).result()

    def insert_later(self, group_id: str, worker_id: str, n_seqs: int, version: int,
                     payload: bytes) -> Future[int | None]:
        """Queue one group for the next group commit; the future resolves once it is durable."""
        done: Future[int | None] = Future()
        with self._pending_changed:
            if self._closing:
                raise StateFileError(f"rollout store {self.path} is closed")
            self._pending.append(_PendingInsert((group_id, worker_id, n_seqs, version, len(payload), payload), done))
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="rollout-store-writer", daemon=True)
                self._writer.start()
            self._pending_changed.notify()
        return done

    def _write_loop(self) -> None:
        while True:
            with self._pending_changed:
                while not self._pending and not self._closing:
                    self._pending_changed.wait()
                if not self._pending:
                    return
                waiting, self._pending = self._pending, []
            self._commit(waiting)

    def _commit(self, waiting: list[_PendingInsert]) -> None:
        """One transaction for every waiting insert; each future resolves after the commit."""
        seqs: list[int | None] = []
        try:
            with self._lock:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    for item in waiting:
                        try:
                            seqs.append(int(self._db.execute(INSERT_GROUP, item.row).lastrowid or 0))
                        except sqlite3.IntegrityError:  # that id is stored already: only this row is undone
                            seqs.append(None)
                    self._db.execute("COMMIT")
                    self.commits += 1
                except BaseException:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise
        except Exception as exc:  # nothing of this transaction is stored: every caller hears so
            for item in waiting:
                item.done.set_exception(StateFileError(f"rollout store {self.path}: commit failed: {exc}"))
            return
        for item, seq in zip(waiting, seqs, strict=True):
            item.done.set_result(seq)

    def hand_out(self, batch_id: str, group_ids: list[str], now_s: float) -> list[bytes]:
        """Record a batch and return its payloads (in the given order), in one transaction."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT INTO batches (id, created_s) VALUES (?, ?)", (batch_id, now_s))
                self._db.executemany("UPDATE groups SET state='handed', batch_id=? WHERE id=?",
                                     [(batch_id, g) for g in group_ids])
                rows = dict(self._db.execute(
                    f"SELECT id, payload FROM groups WHERE id IN ({','.join('?' * len(group_ids))})", group_ids))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return [rows[g] for g in group_ids]

    def batch_payloads(self, batch_id: str) -> list[tuple[str, bytes]]:
        with self._lock:
            return list(self._db.execute("SELECT id, payload FROM groups WHERE batch_id=? ORDER BY seq", (batch_id,)))

    def ack(self, batch_id: str) -> bool | None:
        """Mark a batch delivered. None: unknown batch; False: it was already acknowledged."""
        with self._lock:
            row = self._db.execute("SELECT acked FROM batches WHERE id=?", (batch_id,)).fetchone()
            if row is None:
                return None
            if row[0]:
                return False
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("UPDATE batches SET acked=1 WHERE id=?", (batch_id,))
            self._db.execute("UPDATE groups SET state='delivered', payload=X'' WHERE batch_id=?", (batch_id,))
            self._db.execute("COMMIT")
            return True

    def drop(self, group_ids: Iterable[str]) -> None:
        with self._lock:
            self._db.executemany("UPDATE groups SET state='dropped', payload=X'' WHERE id=?", [(g,) for g in group_ids])

    def queued(self) -> list[StoredGroup]:
        """Groups waiting, in arrival order (for a restart)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, id, worker_id, n_seqs, version, nbytes FROM groups WHERE state='queued' ORDER BY seq")
            return [StoredGroup(*r) for r in rows]

    def unacked_batches(self) -> list[tuple[str, list[StoredGroup]]]:
        """Batches handed out and never acknowledged, oldest first, with their groups."""
        with self._lock:
            batches = [r[0] for r in self._db.execute("SELECT id FROM batches WHERE acked=0 ORDER BY created_s")]
            out = []
            for batch_id in batches:
                rows = self._db.execute("SELECT seq, id, worker_id, n_seqs, version, nbytes FROM groups "
                                        "WHERE batch_id=? ORDER BY seq", (batch_id,))
                out.append((batch_id, [StoredGroup(*r) for r in rows]))
            return out

    def counts(self) -> dict[str, int]:
        """Sequences per state (for status after a restart)."""
        with self._lock:
            return {state: int(n) for state, n in
                    self._db.execute("SELECT state, COALESCE(SUM(n_seqs), 0) FROM groups GROUP BY state")}

    def get_meta(self, key: str, default: str = "") -> str:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
            return str(row[0]) if row else default

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            self._db.execute("INSERT INTO meta (key, value) VALUES (?, ?) "
                             "ON CONFLICT(key) DO UPDATE SET value=excluded.value", (key, value))
