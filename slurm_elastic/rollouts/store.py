"""The durable side of the rollout queue: a payload log and a SQLite index in the job's state directory.

A submitted group's body is appended to the payload log (:mod:`segments`); its row (id, worker,
size, version, state, where its body is) goes to SQLite in WAL mode. Submits are group-committed:
everything that arrived while the previous commit was on its way to disk goes in the next one,
and each caller is answered only once its commit is durable (with the default ``fsync =
"always"``: the log fdatasynced). The fdatasync and the index write happen in the syncer
process (:mod:`syncer`), driven from the event loop that serves the submits, so the loop never
waits for the disk or for another thread. Groups move queued -> handed (in a batch) ->
delivered (the trainer acknowledged the batch) or dropped (too stale); batches handed out and
never acknowledged are handed out again, with the same id, after a trainer or controller
restart. Batch and acknowledgement transactions are fsynced by SQLite itself; they also make
every index row written before them durable, so after a power loss the index is a prefix of
the log, and what the log holds past it is indexed again at open.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import select
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts import syncer
from slurm_elastic.rollouts.segments import (
    BLOCK_BYTES,
    SEGMENT_BYTES,
    SegmentLog,
    StagingBuffer,
    group_head,
    json_str,
    records_bytes,
)

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
"""
ROWS_PER_COMMIT = 1024  # a bigger backlog goes in several commits
COMMIT_BYTES = 8 * 1024 * 1024  # and so does a backlog of more bytes (a bigger group goes alone)
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
LIVE_STATES = "('queued', 'handed')"
T = TypeVar("T")
Then = Callable[[T, BaseException | None], None]
"""Called once with an outcome, or with the error that stood in its way (then the outcome is a
placeholder). Lighter than a Future on the hot path: no lock, no condition."""


def settle(future: Future[T] | asyncio.Future[T]) -> Then[T]:
    """A :data:`Then` that settles ``future`` (on the calling thread)."""
    def then(result: T, error: BaseException | None) -> None:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    return then


class StoredGroup(NamedTuple):
    """A queued group's record in memory (a tuple of atoms: the garbage collector skips it)."""

    seq: int
    id: str
    worker_id: str
    n_seqs: int
    version: int
    nbytes: int


class _PendingInsert(NamedTuple):
    group_id: str
    worker_id: str
    n_seqs: int
    version: int
    payload: bytes
    then: Then[int | None]


@dataclass
class _Commit:
    items: list[_PendingInsert]
    first_seq: int
    segment: int
    start: int  # the log's size before this commit's records
    reply: bytearray


class RolloutStore:
    """The rollout store. Thread-safe: the index behind a lock; submits group-committed on the
    event loop of the first caller that has one (the API server's), or else on a private one."""

    def __init__(self, path: Path, fsync: str = "always", segment_bytes: int = SEGMENT_BYTES,
                 direct_io: bool = True) -> None:
        if fsync not in SYNCHRONOUS:
            raise ValueError(f"fsync must be one of {', '.join(SYNCHRONOUS)}")
        self.path = path
        self.fsync = fsync
        self.direct_io = direct_io and fsync == "always"  # the syncer writes the log with O_DIRECT
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={SYNCHRONOUS[fsync]}")
            self._db.execute("PRAGMA busy_timeout=30000")  # the syncer writes index rows too
            self._db.executescript(SCHEMA)
            columns = {r[1] for r in self._db.execute("PRAGMA table_info(groups)")}
            for column in sorted({"segment", "body_offset"} - columns):  # a store from before the payload log
                self._db.execute(f"ALTER TABLE groups ADD COLUMN {column} INTEGER")
        except sqlite3.DatabaseError as exc:
            raise StateFileError(f"rollout store {path} is unusable: {exc}") from None
        self.log = SegmentLog(path.with_name(path.stem + ".segments"), segment_bytes)
        self._next_seq = self._recover_log() + 1
        self._live: collections.Counter[int] = collections.Counter(dict(self._db.execute(
            f"SELECT segment, COUNT(*) FROM groups WHERE state IN {LIVE_STATES} AND segment IS NOT NULL "
            "GROUP BY segment")))
        for number in self.log.numbers():
            if not self._live[number]:
                self.log.delete(number)
        self._pending: list[_PendingInsert] = []
        self._pending_lock = threading.Lock()
        self._flush_scheduled = False
        self._in_flight: _Commit | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._private_loop: asyncio.AbstractEventLoop | None = None
        self._syncer: subprocess.Popen[bytes] | None = None
        self._staging: StagingBuffer | None = None  # made with the first commit
        self._closing = False
        self.commits = 0  # group commits done (fewer than inserts under concurrency)

    # ---- opening ----------------------------------------------------------------------------
    def _recover_log(self) -> int:
        """Index what the log holds past the index (after a crash or power loss); the highest
        arrival number now known."""
        row = self._db.execute(
            "SELECT seq, segment, body_offset, nbytes FROM groups ORDER BY seq DESC LIMIT 1").fetchone()
        max_seq = int(row[0]) if row else 0
        segment, offset = (int(row[1]), int(row[2]) + int(row[3])) if row and row[1] is not None else (0, 0)
        found = [(n, r) for n, r in self.log.records_after(segment, offset) if int(r.head["seq"]) > max_seq]
        if found:
            with self._lock:
                self._db.execute("BEGIN IMMEDIATE")
                for number, record in found:
                    h = record.head
                    self._db.execute(syncer.insert_rows_sql(1), (h["seq"], h["id"], h["worker_id"], h["n_seqs"],
                                                                 h["version"], record.body_bytes, number,
                                                                 record.body_offset))
                self._db.execute("COMMIT")
            max_seq = max(max_seq, *(int(r.head["seq"]) for _n, r in found))
        return max_seq

    def close(self) -> None:
        """Commit what is waiting, stop the syncer, close the index and the log."""
        with self._pending_lock:
            self._closing = True  # no new submits; the ones taken are committed
            loop = self._loop
        if loop is not None and loop.is_running():
            settled: Future[None] = Future()

            def when_settled() -> None:
                if self._in_flight is None and not self._pending and not self._flush_scheduled:
                    settled.set_result(None)
                else:
                    loop.call_later(0.001, when_settled)
            loop.call_soon_threadsafe(when_settled)
            settled.result(timeout=120)
        self._drain_blocking()  # a loop that has stopped may have left a commit behind
        if self._private_loop is not None:
            self._private_loop.call_soon_threadsafe(self._private_loop.stop)
        if self._syncer is not None:
            assert self._syncer.stdin is not None
            self._syncer.stdin.close()
            self._syncer.wait()
        if self._staging is not None:
            self._staging.close()
        with self._lock:
            self._db.close()
        self.log.close()

    # ---- submits ----------------------------------------------------------------------------
    def insert(self, group_id: str, worker_id: str, n_seqs: int, version: int, payload: bytes) -> int | None:
        """Commit one group; its arrival number, or None if that id is already stored."""
        return self.insert_later(group_id, worker_id, n_seqs, version, payload).result()

    def insert_later(self, group_id: str, worker_id: str, n_seqs: int, version: int,
                     payload: bytes) -> Future[int | None]:
        """Queue one group for the next group commit; the future resolves once it is durable."""
        done: Future[int | None] = Future()
        self.insert_then(group_id, worker_id, n_seqs, version, payload, settle(done))
        return done

    def insert_then(self, group_id: str, worker_id: str, n_seqs: int, version: int, payload: bytes,
                    then: Then[int | None]) -> None:
        """Queue one group for the next group commit; ``then`` hears its arrival number (None if
        that id is already stored) once it is durable, on the committing loop's thread."""
        item = _PendingInsert(group_id, worker_id, n_seqs, version, payload, then)
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        with self._pending_lock:
            if self._closing:
                raise StateFileError(f"rollout store {self.path} is closed")
            if self._loop is None or self._loop.is_closed():
                self._loop = running or self._start_private_loop()
            loop = self._loop
        if loop is running:
            self._enqueue(item)
        else:
            loop.call_soon_threadsafe(self._enqueue, item)

    def _start_private_loop(self) -> asyncio.AbstractEventLoop:
        """For callers without an event loop (tools, tests): one in a thread of its own."""
        loop = self._private_loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="rollout-store-commits", daemon=True).start()
        return loop

    def _enqueue(self, item: _PendingInsert) -> None:
        """On the committing loop: wait for the next commit, which starts once this loop turn ends."""
        with self._pending_lock:
            self._pending.append(item)
            if self._flush_scheduled or self._in_flight is not None:
                return
            self._flush_scheduled = True
        asyncio.get_running_loop().call_soon(self._begin_async)

    def _begin_async(self) -> None:
        with self._pending_lock:
            self._flush_scheduled = False
            if self._in_flight is not None:
                return
            commit = self._begin()
        if commit is not None:
            self._watch_reply()

    def _begin(self) -> _Commit | None:
        """Lay the waiting groups out in the staging buffer and send them to the syncer, which
        writes them to the log (pending lock held)."""
        taken = nbytes = 0
        for it in self._pending[:ROWS_PER_COMMIT]:
            nbytes += len(it.payload)
            if taken and nbytes > COMMIT_BYTES:
                break
            taken += 1
        items, self._pending = self._pending[:taken], self._pending[taken:]
        if not items:
            return None
        first_seq = self._next_seq
        self._next_seq += len(items)
        ids = [(json_str(it.group_id), json_str(it.worker_id)) for it in items]
        heads = [group_head(first_seq + i, *ids[i], it.n_seqs, it.version) for i, it in enumerate(items)]
        start = -1
        try:
            if self._staging is None:
                self._staging = StagingBuffer(COMMIT_BYTES)
            bodies = [it.payload for it in items]
            segment, start = self.log.place(records_bytes(heads, bodies))
            nbytes, body_at = self._staging.stage(heads, bodies, start % BLOCK_BYTES)
            rows = [b"[%d,%s,%s,%d,%d,%d,%d]" % (first_seq + i, *ids[i], it.n_seqs, it.version, len(it.payload),
                                                  start + body_at[i])
                    for i, it in enumerate(items)]
            self._send(b'{"segment":%d,"offset":%d,"nbytes":%d,"rows":[%s]}\n'
                       % (segment, start, nbytes, b",".join(rows)))
        except (OSError, StateFileError) as exc:
            if start >= 0:
                self.log.truncate(start)
            self._fail(items, str(exc))
            return None
        commit = self._in_flight = _Commit(items, first_seq, segment, start, bytearray())
        return commit

    def _send(self, line: bytes) -> None:
        """One line to the syncer (see :mod:`syncer`), started first if it is not running. A
        syncer that died since its last answer read nothing of it: the line goes to a new one
        (the syncer writes at the offset the line gives, so a half-done write is redone whole)."""
        for _attempt in range(2):
            if self._syncer is None:
                self._syncer = self._start_syncer()
            assert self._syncer.stdin is not None
            try:
                self._syncer.stdin.write(line)
                self._syncer.stdin.flush()
                return
            except OSError as exc:
                error = exc
                self._retire_syncer()
        raise StateFileError(f"rollout store {self.path}: the syncer is gone ({error})")

    def _start_syncer(self) -> subprocess.Popen[bytes]:
        assert self._staging is not None
        process = subprocess.Popen(
            [sys.executable, "-I", "-c", syncer.COMMAND, PACKAGE_ROOT, str(self.path), str(self.log.directory),
             self.fsync, str(self._staging.fd), "direct" if self.direct_io else "buffered"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=[self._staging.fd])
        assert process.stdout is not None
        os.set_blocking(process.stdout.fileno(), False)
        return process

    def _retire_syncer(self) -> None:
        """The syncer died (or is no use): reap it; the next commit starts another."""
        process, self._syncer = self._syncer, None
        if process is None:
            return
        process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass  # a buffered line that can no longer be sent

    def _watch_reply(self) -> None:
        assert self._syncer is not None and self._syncer.stdout is not None
        asyncio.get_running_loop().add_reader(self._syncer.stdout.fileno(), self._on_reply)

    def _on_reply(self) -> None:
        """The syncer's answer is readable (on the committing loop)."""
        assert self._syncer is not None and self._syncer.stdout is not None
        fd = self._syncer.stdout.fileno()
        if not self._read_reply(fd):
            return
        asyncio.get_running_loop().remove_reader(fd)
        with self._pending_lock:
            answers = self._finish()
            if self._pending and self._begin() is not None:
                self._watch_reply()  # a syncer of its own if this one died
        for then, seq in answers:  # once the next commit is on its way: the syncer does not wait for these
            then(seq, None)

    def _read_reply(self, fd: int) -> bool:
        """Read what the syncer has sent; True once the whole answer (or its end) is in."""
        commit = self._in_flight
        assert commit is not None
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        commit.reply += chunk if chunk else b"\n"  # end of file: the syncer died mid-commit
        return commit.reply.endswith(b"\n")

    def _finish(self) -> list[tuple[Then[int | None], int | None]]:
        """Settle the commit in flight (pending lock held): a failed one's callers are told at
        once; a durable one's answers (each caller with its arrival number, None for an id
        stored already) are returned, to be given once the next commit is sent."""
        commit, self._in_flight = self._in_flight, None
        assert commit is not None
        try:
            reply = json.loads(commit.reply or b"{}")
        except ValueError:
            reply = {}
        if "ignored" not in reply:
            reply = self._after_syncer_failure(commit, reply.get("error"))
            if reply is None:
                return []
        ignored = set(reply["ignored"])
        self.commits += 1
        seqs = [commit.first_seq + i for i in range(len(commit.items))]
        with self._lock:
            self._live[commit.segment] += len(seqs) - len(ignored)
        return [(item.then, None if seq in ignored else seq) for item, seq in zip(commit.items, seqs, strict=True)]

    def _after_syncer_failure(self, commit: _Commit, error: str | None) -> dict[str, Any] | None:
        """The syncer answered ``error``, or died (None): if it indexed the commit before dying,
        the commit stands; otherwise the records come off the log and every caller hears of it."""
        last = commit.first_seq + len(commit.items) - 1
        if error is None:
            self._retire_syncer()  # reaped before its rows are looked for: it can write no more
        with self._lock:
            stored = {int(r[0]) for r in self._db.execute(
                "SELECT seq FROM groups WHERE seq BETWEEN ? AND ?", (commit.first_seq, last))}
        if stored and error is None:
            return {"ignored": [s for s in range(commit.first_seq, last + 1) if s not in stored]}
        if self.log.current == commit.segment:
            self.log.truncate(commit.start)
        self._fail(commit.items, error or "the syncer exited")
        return None

    def _fail(self, items: list[_PendingInsert], error: str) -> None:
        for item in items:
            item.then(None, StateFileError(f"rollout store {self.path}: commit failed: {error}"))

    def _drain_blocking(self) -> None:
        """At close: finish the commit in flight and commit what waits, without an event loop."""
        with self._pending_lock:
            while self._in_flight is not None or self._pending:
                if self._in_flight is None and self._begin() is None:
                    continue
                assert self._syncer is not None and self._syncer.stdout is not None
                fd = self._syncer.stdout.fileno()
                while not self._read_reply(fd):
                    select.select([fd], [], [])
                for then, seq in self._finish():
                    then(seq, None)

    def hand_out(self, batch_id: str, group_ids: list[str], now_s: float) -> list[bytes]:
        """Record a batch and return its payloads (in the given order), in one transaction."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT INTO batches (id, created_s) VALUES (?, ?)", (batch_id, now_s))
                self._db.executemany("UPDATE groups SET state='handed', batch_id=? WHERE id=?",
                                     [(batch_id, g) for g in group_ids])
                rows = {r[0]: r[1:] for r in self._db.execute(
                    f"SELECT id, segment, body_offset, nbytes, payload FROM groups "
                    f"WHERE id IN ({','.join('?' * len(group_ids))})", group_ids)}
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return [self._body(*rows[g]) for g in group_ids]

    def _body(self, segment: int | None, offset: int | None, nbytes: int, payload: bytes) -> bytes:
        """A group's body: from the log, or (a store from before the log) from its row."""
        return payload if segment is None or offset is None else self.log.read(segment, offset, nbytes)

    def batch_payloads(self, batch_id: str) -> list[tuple[str, bytes]]:
        with self._lock:
            rows = list(self._db.execute("SELECT id, segment, body_offset, nbytes, payload FROM groups "
                                         "WHERE batch_id=? ORDER BY seq", (batch_id,)))
        return [(r[0], self._body(*r[1:])) for r in rows]

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
            freed = list(self._db.execute("SELECT segment, COUNT(*) FROM groups WHERE batch_id=? "
                                          "AND segment IS NOT NULL GROUP BY segment", (batch_id,)))
            self._db.execute("UPDATE groups SET state='delivered', payload=X'' WHERE batch_id=?", (batch_id,))
            self._db.execute("COMMIT")
            self._release(freed)
            return True

    def drop(self, group_ids: Iterable[str]) -> None:
        ids = list(group_ids)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            freed = list(self._db.execute(
                f"SELECT segment, COUNT(*) FROM groups WHERE id IN ({','.join('?' * len(ids))}) "
                f"AND state IN {LIVE_STATES} AND segment IS NOT NULL GROUP BY segment", ids))
            self._db.executemany("UPDATE groups SET state='dropped', payload=X'' WHERE id=?", [(g,) for g in ids])
            self._db.execute("COMMIT")
            self._release(freed)

    def _release(self, freed: list[tuple[int, int]]) -> None:
        """Groups left the live states (lock held): delete segments nobody needs any more."""
        for segment, n in freed:
            self._live[segment] -= n
            if self._live[segment] <= 0:
                del self._live[segment]
                self.log.delete(segment)

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

    def arrived_since(self, seq: int) -> tuple[int, dict[str, int]]:
        """The highest arrival number stored, and the sequences per worker of the groups stored
        after arrival ``seq`` (for the queue's staleness counts at a restart)."""
        with self._lock:
            last = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM groups").fetchone()[0]
            rows = self._db.execute("SELECT worker_id, SUM(n_seqs) FROM groups WHERE seq > ? GROUP BY worker_id",
                                    (seq,))
            return int(last), {str(w): int(n) for w, n in rows}
