"""The rollout store's group commits: submits go to the payload log and the index in batches.

Everything that arrived while the previous commit was on its way to disk goes in the next one,
and each caller is answered only once its commit is durable (with the default ``fsync =
"always"``: the log fdatasynced). The event loop lays a commit's records out in the staging
buffer it shares with the syncer process (:mod:`syncer`), which writes them, fdatasyncs the
log and indexes the rows, so the loop never waits for the disk or for another thread. The
syncer inherits the store's writer lock (:mod:`recovery`) and holds it as long as it lives.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import select
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts import syncer
from slurm_elastic.rollouts.index import StoreIndex
from slurm_elastic.rollouts.recovery import note_holders
from slurm_elastic.rollouts.segments import (
    BLOCK_BYTES,
    SegmentLog,
    StagingBuffer,
    group_head,
    json_str,
    records_bytes,
)
from slurm_elastic.rollouts.storage import StoreUnavailableError, Then, settle

ROWS_PER_COMMIT = 1024  # a bigger backlog goes in several commits
COMMIT_BYTES = 8 * 1024 * 1024  # and so does a backlog of more bytes (a bigger group goes alone)
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


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

class GroupCommits:
    """The submit side of the store (:class:`store.RolloutStore` is one): group commits on the
    event loop of the first caller that has one (the API server's), or else on a private one."""

    path: Path
    fsync: str
    direct_io: bool
    log: SegmentLog
    _index: StoreIndex
    _live: collections.Counter[int]
    _next_seq: int
    _writer_lock: int
    _dir_lock: int | None

    def _init_commits(self) -> None:
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

    def _close_commits(self) -> None:
        """Commit what is waiting, stop the syncer."""
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
    # ---- submits ----------------------------------------------------------------------------
    def insert(self, group_id: str, worker_id: str, n_seqs: int, version: int, payload: bytes) -> int | None:
        """Commit one group; its arrival number, or None if that id is already stored."""
        return self.insert_later(group_id, worker_id, n_seqs, version, payload).result()

    def insert_later(self, group_id: str, worker_id: str, n_seqs: int, version: int,
                     payload: bytes) -> Future[int | None]:
        """Queue one group for the next group commit; the future resolves once it is durable."""
        done: Future[int | None] = Future()
        self.submit(group_id, worker_id, n_seqs, version, payload, settle(done))
        return done

    def submit(self, group_id: str, worker_id: str, n_seqs: int, version: int, payload: bytes,
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
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            pass_fds=[self._staging.fd, self._writer_lock, *([self._dir_lock] if self._dir_lock is not None else [])])
        note_holders(self._writer_lock, process.pid)  # it holds the writer lock as long as it lives
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
        with self._index.lock:
            self._live[commit.segment] += len(seqs) - len(ignored)
        return [(item.then, None if seq in ignored else seq) for item, seq in zip(commit.items, seqs, strict=True)]

    def _after_syncer_failure(self, commit: _Commit, error: str | None) -> dict[str, Any] | None:
        """The syncer answered ``error``, or died (None): if it indexed the commit before dying,
        the commit stands; otherwise the records come off the log and every caller hears of it."""
        last = commit.first_seq + len(commit.items) - 1
        if error is None:
            self._retire_syncer()  # reaped before its rows are looked for: it can write no more
        stored = self._index.stored_seqs(commit.first_seq, last)
        if stored and error is None:
            return {"ignored": [s for s in range(commit.first_seq, last + 1) if s not in stored]}
        if self.log.current == commit.segment:
            self.log.truncate(commit.start)
        self._fail(commit.items, error or "the syncer exited")
        return None

    def _fail(self, items: list[_PendingInsert], error: str) -> None:
        for item in items:
            item.then(None, StoreUnavailableError(f"rollout store {self.path}: commit failed: {error}"))

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

