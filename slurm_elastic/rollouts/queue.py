"""The bounded rollout queue: sequences in memory as small records, payloads on disk.

Submits past the capacity (sequences or bytes) are refused with a retry-after hint, and so
are groups already too stale or of a version the trainer has not reached (nothing stored). The
trainer pulls batches of exactly ``batch_size`` sequences made of whole groups, the oldest that
make one within a bounded look-ahead (:mod:`.packing`), however long the queue; groups older than
the staleness bound when the trainer pulls, or made past the version it resumed at from an
earlier checkpoint (also out of a batch handed out again), are dropped and counted. Batches are
acknowledged by the trainer; unacknowledged ones are handed out again (same id, same content)
after a restart of the trainer or of the controller, and to a pull that repeats the ``pull_id``
of the one that got it (a retry after a lost answer).

The queue keeps its groups through a :class:`~slurm_elastic.rollouts.storage.RolloutStorage`
and its staleness counts in a :class:`~slurm_elastic.rollouts.admissions.StalenessBook`; both
survive a controller restart exactly.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from slurm_elastic.core.pressure import QueueSnapshot
from slurm_elastic.core.rates import (
    CONSUMPTION_WINDOW_S,
    PRODUCTION_WINDOW_S,
    TrainerSteps,
    WindowRate,
)
from slurm_elastic.core.staleness import AdmissionLeases, StalenessManager, VersionRefused, is_stale
from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.admissions import StalenessBook
from slurm_elastic.rollouts.config import QueueConfig
from slurm_elastic.rollouts.lost_reports import LostReports
from slurm_elastic.rollouts.queued import QueuedGroups
from slurm_elastic.rollouts.refusals import (
    GroupRefused,
    QueueFull,
    StaleGroup,
    TrainerSessionRefused,
    TrainerSessionUnknown,
    TrainerSuperseded,
    UnknownBatchError,
    VersionAhead,
)
from slurm_elastic.rollouts.storage import LostGroup, RolloutStorage, StoredGroup, Then, settle

__all__ = ["GroupRefused", "QueueConfig", "QueueFull", "RolloutQueue", "StaleGroup", "TrainerSessionRefused",
           "TrainerSessionUnknown", "TrainerSuperseded", "UnknownBatchError", "VersionAhead", "VersionRefused"]
log = logging.getLogger(__name__)
PULL_IDS_KEPT = 1024  # pull ids remembered (with their batch) for retries of those pulls


class RolloutQueue:
    """Thread-safe queue over a :class:`~slurm_elastic.rollouts.storage.RolloutStorage`."""

    def __init__(self, store: RolloutStorage, config: QueueConfig, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self._lock = threading.Lock()
        self._queued = QueuedGroups()
        self._committing_seqs = 0  # accepted under the bound, waiting for their group commit
        self._committing_bytes = 0
        self._rehand: collections.deque[tuple[str, list[StoredGroup]]] = collections.deque()
        self._handed: dict[str, list[StoredGroup]] = {}
        self._pull_ids: collections.OrderedDict[str, str] = collections.OrderedDict()  # pull id -> its batch
        self._pull_lock = threading.Lock()  # one pull at a time: a retry waits for the pull it repeats
        self.delivered_seqs = 0
        self.dropped_stale_seqs = 0
        self.refused_submits = 0
        self.refused_stale_seqs = 0  # in groups refused at submit for their policy version (this run)
        self.lost_groups = 0  # quarantined: their records in the log were damaged
        self.lost_seqs = 0
        self._lost_reports = LostReports([], 0)  # which lost groups the trainer was told of
        self._trainer_session = 0  # the newest trainer registration's session (saved; 0: none yet)
        self.in_use = False  # a trainer registered or pulled, or rollouts arrived: the buffer means something
        self._pulls = WindowRate(CONSUMPTION_WINDOW_S)
        self._accepts = WindowRate(PRODUCTION_WINDOW_S)
        self._trainer_steps = TrainerSteps()  # the trainer's compute time: a batch handed out -> its next pull
        self._trainer_heard_s: float | None = None  # the trainer's last call (register, pull, ack, version)
        self.book = StalenessBook(store, self._lock, config.batch_size, config.max_staleness, config.max_concurrent,
                                  config.admission_ttl_s)
        self._recover()

    @property
    def staleness(self) -> StalenessManager:
        return self.book.staleness

    @property
    def leases(self) -> AdmissionLeases:
        return self.book.leases

    def _recover(self) -> None:
        recovered = self.store.recover()
        for batch_id, groups in recovered.unacked:
            self._rehand.append((batch_id, groups))
            self._handed[batch_id] = groups
        for group in recovered.queued:
            self._queued.append(group)
        counts = recovered.seqs_by_state
        self.in_use = bool(counts)
        self.lost_groups, self.lost_seqs = len(recovered.lost), sum(g.n_seqs for g in recovered.lost)
        self._lost_reports = LostReports([g.id for g in recovered.lost], recovered.lost_told)
        self.delivered_seqs = counts.get("delivered", 0)
        self._trainer_session = recovered.trainer_session
        self.dropped_stale_seqs = counts.get("dropped", 0)
        self.book.recover(recovered, self.dropped_stale_seqs + self.lost_seqs, self.clock())

    def _buffered_seqs(self) -> int:
        """Sequences the trainer will still get: queued, or handed out and not acknowledged."""
        return self._queued.seqs + sum(g.n_seqs for groups in self._handed.values() for g in groups)

    # ---- workers -----------------------------------------------------------------------------
    def admit(self, n_seqs: int, worker_id: str, admission_id: str = "") -> int:
        """The capacity gate: how many of ``n_seqs`` ``worker_id`` may start now (staleness and
        concurrency); they are its lease, recorded durably before this returns. A retry with the
        same ``admission_id`` (its answer lost) gets the same grant, granted once."""
        return self.book.admit(worker_id, n_seqs, self.clock(), admission_id)

    def release_leases(self, worker_ids: list[str]) -> int:
        """The steps of ``worker_ids`` have ended (failed, drained, cancelled, or now a
        placeholder): what their leases hold is released and saved (a save that fails is logged and
        made by the next admission); returns the sequences released. A late submit of theirs is
        accepted as unadmitted."""
        released = self.book.released(worker_ids) if worker_ids else 0
        if released:
            self.save_counts()
        return released

    def expire_admissions(self) -> None:
        """Release leases past the admission TTL (:meth:`snapshot` and :meth:`stats` do so too)."""
        with self._lock:
            self.leases.expire(self.clock())

    def submit(self, group_id: str, worker_id: str, n_seqs: int, version: int, payload: bytes) -> bool:
        """Store a group durably; False if that id was already accepted (a retry). Raises
        QueueFull, VersionAhead or StaleGroup (either's release from its lease saved first)."""
        try:
            return self.submit_later(group_id, worker_id, n_seqs, version, payload).result()
        except (StaleGroup, VersionAhead):
            self.save_counts()
            raise

    def submit_later(self, group_id: str, worker_id: str, n_seqs: int, version: int,
                     payload: bytes) -> Future[bool]:
        """Like :meth:`submit`, without waiting: the future resolves once the group is durable.
        QueueFull is raised at once."""
        accepted: Future[bool] = Future()
        self.submit_then(group_id, worker_id, n_seqs, version, payload, settle(accepted))
        return accepted

    def submit_then(self, group_id: str, worker_id: str, n_seqs: int, version: int, payload: bytes,
                    then: Then[bool]) -> None:
        """Like :meth:`submit`, for an event loop: ``then`` hears whether the group was stored
        (False: a retry of one accepted already) once it is durable, on the store's committing
        loop. QueueFull and the refusals of :meth:`_version_refusal` are raised at once; a resend
        of a group stored before is a retry whatever its version now (nothing released twice)."""
        cfg = self.config
        with self._lock:
            retry = group_id in self._queued  # a retry of a queued group (the store catches older ones)
            refusal = None if retry else self._version_refusal(version)
        if refusal is not None and self.store.known(group_id):  # outside the lock: the index may be busy
            retry, refusal = True, None  # delivered, dropped or handed out already: its answer is "retry"
        with self._lock:
            if refusal is not None:
                self.book.refused(worker_id, n_seqs, self.clock())  # AReaL's on_rollout_rejected (saved by save_counts)
                if isinstance(refusal, StaleGroup):
                    self.refused_stale_seqs += n_seqs
                raise refusal
            full = None
            if not retry:
                queued_seqs = self._queued.seqs + self._committing_seqs
                queued_bytes = self._queued.nbytes + self._committing_bytes
                if queued_seqs + n_seqs > cfg.capacity_seqs or queued_bytes + len(payload) > cfg.capacity_bytes:
                    full = QueueFull(f"rollout buffer full ({queued_seqs}/{cfg.capacity_seqs} sequences, "
                                     f"{queued_bytes}/{cfg.capacity_bytes} bytes)", self._retry_after_s())
                else:
                    self._committing_seqs += n_seqs  # held against the bound until the commit (no overshoot)
                    self._committing_bytes += len(payload)
        if full is not None:
            if not self.store.known(group_id):  # outside the lock, as above
                with self._lock:
                    self.refused_submits += 1
                raise full
            retry = True  # delivered or handed out already: a retry, whether or not the buffer has room
        if retry:
            then(False, None)  # outside the lock: ``then`` may call back into the queue
            return

        def committed(seq: int | None, error: BaseException | None) -> None:
            with self._lock:
                self._committing_seqs -= n_seqs
                self._committing_bytes -= len(payload)
                if seq is not None:
                    self._queued.append(StoredGroup(seq, group_id, worker_id, n_seqs, version, len(payload)))
                    self.in_use = True
                    now_s = self.clock()
                    self.book.accepted(worker_id, n_seqs, seq, now_s)
                    self._accepts.add(now_s, n_seqs)
            then(seq is not None, error)

        try:
            self.store.submit(group_id, worker_id, n_seqs, version, payload, committed)
        except BaseException:
            with self._lock:
                self._committing_seqs -= n_seqs
                self._committing_bytes -= len(payload)
            raise

    def _version_refusal(self, version: int) -> VersionAhead | StaleGroup | None:
        """Why no trainer step could use a group of ``version`` (lock held): VersionAhead past the
        trainer's version, StaleGroup older than the bound; None if one can."""
        current, max_staleness = self.staleness.version, self.config.max_staleness
        if version > current:
            return VersionAhead(version, current)
        if is_stale(version, current, max_staleness):
            return StaleGroup(version, current, max_staleness)
        return None

    def save_counts(self) -> None:
        """Save the staleness counts changed in memory only (a stale group's lease released). A
        store that cannot write is logged: the counts stay right here and the next admission or
        version saves them."""
        try:
            self.book.save()
        except (OSError, StateFileError) as exc:
            log.warning("could not save the staleness counts (the next admission will): %s", exc)

    def _retry_after_s(self) -> float:
        rate = self._pulls.rate(self.clock())
        return 1.0 if not rate else max(0.1, min(30.0, self.config.batch_size / rate))

    # ---- trainer -----------------------------------------------------------------------------
    def pull(self, pull_id: str | None = None, session: int | None = None) -> tuple[str, list[bytes]] | None:
        """The next batch (id, group payloads) of exactly ``batch_size`` sequences, or None if
        not enough. Unacknowledged batches to hand out again (after a restart) come first; a
        ``pull_id`` that got a batch still unacknowledged gets that batch again (a retry after a
        lost answer), one whose batch was acknowledged gets None. Every payload is checked first:
        a damaged group is quarantined (see :meth:`lost_ids_for`) and the batch is made of
        others. A batch handed out again keeps its id, without any of its groups lost since.
        StoreUnavailableError (disk full): nothing changed, try again. ``session``: the
        caller's trainer session (:meth:`trainer_restarted`); an older one than the newest is
        refused (:class:`TrainerSuperseded`), as is one never issued (:class:`TrainerSessionUnknown`),
        and nothing is handed out to it."""
        with self._pull_lock:
            self.check_trainer(session)
            with self._lock:
                self.in_use = True
                self._trainer_heard_s = self.clock()
                self._trainer_steps.asked(self._trainer_heard_s)
                earlier = self._pull_ids.get(pull_id) if pull_id is not None else None
                if earlier is not None and earlier not in self._handed:
                    return None  # a late copy of a pull whose batch was acknowledged
            batch = None if earlier is None else self._hand_again(earlier, requeue=False)
            if batch is not None:
                with self._lock:
                    if earlier not in self._handed:  # acknowledged while it was read again: a late copy
                        return None
            if batch is None:
                batch = self._pull_fresh()
            if batch is not None and pull_id is not None:
                with self._lock:
                    self._rehand = collections.deque(b for b in self._rehand if b[0] != batch[0])
                    self._pull_ids[pull_id] = batch[0]
                    self._pull_ids.move_to_end(pull_id)
                    if len(self._pull_ids) > PULL_IDS_KEPT:
                        self._pull_ids.popitem(last=False)
            return batch

    def _pull_fresh(self) -> tuple[str, list[bytes]] | None:
        """A batch waiting to be handed out again, else a new one."""
        while True:
            with self._lock:
                rehand = self._rehand.popleft() if self._rehand else None
            if rehand is None:
                return self._pull_new()
            batch = self._hand_again(rehand[0], requeue=True)
            if batch is not None:
                return batch

    def _pull_new(self) -> tuple[str, list[bytes]] | None:
        """A new batch packed from the queue, its hand-out recorded."""
        while True:
            with self._lock:
                self._drop_untrainable()
                chosen = self._queued.take_batch(self.config.batch_size, self.config.lookahead_groups)
                if chosen is None:  # (taken out of the queue while their hand-out is recorded)
                    return None
            batch_id = uuid.uuid4().hex
            try:
                pulled = self.store.pull(batch_id, [g.id for g in chosen], self.clock())
            except BaseException:
                self._put_back(chosen)  # a failed pull changes nothing
                raise
            if pulled.lost:
                self._lost(pulled.lost, queued=True)
                lost_ids = {g.id for g in pulled.lost}
                self._put_back([g for g in chosen if g.id not in lost_ids])
                continue  # pack again without them
            with self._lock:
                self._handed[batch_id] = chosen
                self._pulls.add(self.clock(), self.config.batch_size)
                self._trainer_steps.served(self.clock())
            return batch_id, pulled.payloads

    def _hand_again(self, batch_id: str, requeue: bool) -> tuple[str, list[bytes]] | None:
        """An unacknowledged batch, again: its groups checked, the damaged ones quarantined.
        None if every group of it was lost (it is acknowledged then: nothing is left of it).
        ``requeue``: if the store fails, it is first to be handed out again. Its groups made past
        the version the trainer resumed at since are dropped first (:meth:`_drop_ahead`)."""
        try:
            self._drop_ahead(batch_id)
            pulled = self.store.pull_again(batch_id)
            if pulled.lost:
                self._lost(pulled.lost, queued=False)
        except BaseException:
            with self._lock:
                if requeue and batch_id in self._handed:
                    self._rehand.appendleft((batch_id, self._handed[batch_id]))
            raise
        if not pulled.payloads:
            self.ack(batch_id)
            return None
        with self._lock:
            self._trainer_steps.served(self.clock())
        return batch_id, pulled.payloads

    def _put_back(self, groups: list[StoredGroup]) -> None:
        """Groups taken for a batch that was not recorded: queued again where they were."""
        with self._lock:
            self._queued.put_back(groups)

    def _lost(self, lost: list[LostGroup], queued: bool) -> None:
        """Groups quarantined: counted, to be told to the trainer, out of their batch; they
        hold no staleness capacity (never consumed)."""
        ids = {g.id for g in lost}
        with self._lock:
            self.lost_groups += len(lost)
            self.lost_seqs += sum(g.n_seqs for g in lost)
            self._lost_reports.quarantined([g.id for g in lost])
            if not queued:
                for batch_id, groups in self._handed.items():
                    if any(g.id in ids for g in groups):
                        self._handed[batch_id] = [g for g in groups if g.id not in ids]
            self.book.freed(sum(g.n_seqs for g in lost))

    def lost_ids_for(self, batch_id: str) -> list[str]:
        """The quarantined group ids to tell with batch ``batch_id``: those told with it before
        (a retry of its pull, or the batch handed out again) and those quarantined since; told
        again with it until it is acknowledged, so a lost answer loses none of them."""
        with self._lock:
            return self._lost_reports.ids_for(batch_id, batch_id in self._handed)

    def _drop_untrainable(self) -> None:
        """Drop every queued group the trainer cannot train on at its version, wherever it sits
        in the queue (lock held): older than the bound, or made past the version it resumed at
        from an earlier checkpoint (a submit of one now is refused as ahead). Counted as dropped."""
        version = self.staleness.version
        untrainable = self._queued.untrainable(version, self.config.max_staleness)
        if untrainable:
            self._drop(untrainable)
            self._queued.drop(untrainable)
            _log_ahead("queued", [g for g in untrainable if g.version > version], version)

    def _drop_ahead(self, batch_id: str) -> None:
        """Drop the groups of an unacknowledged batch made past the trainer's version (it resumed
        at an earlier checkpoint since the batch was handed out); the batch keeps its id."""
        with self._lock:
            version = self.staleness.version
            ahead = [g for g in self._handed.get(batch_id, []) if g.version > version]
            if ahead:
                self._drop(ahead)
                self._handed[batch_id] = [g for g in self._handed[batch_id] if g.version <= version]
                _log_ahead(f"handed-out (batch {batch_id})", ahead, version)

    def _drop(self, groups: list[StoredGroup]) -> None:
        """Record ``groups`` dropped (lock held): in the store first (if it cannot, nothing changes
        here), counted, and their capacity freed (never consumed, they must not hold it)."""
        self.store.drop(g.id for g in groups)
        dropped = sum(g.n_seqs for g in groups)
        self.dropped_stale_seqs += dropped
        self.book.freed(dropped)

    def ack(self, batch_id: str, session: int | None = None) -> bool:
        """The trainer consumed a batch. Idempotent; raises UnknownBatchError for an unknown id,
        TrainerSuperseded for a ``session`` older than the newest (TrainerSessionUnknown: newer)."""
        self.check_trainer(session)
        self._trainer_heard_s = self.clock()
        result = self.store.ack(batch_id)
        if result is None:
            raise UnknownBatchError(batch_id)
        if not result:  # acknowledged already: the ack that did it settles the batch here, once
            return result
        with self._lock:
            groups = self._handed.pop(batch_id, [])
            told_count = self._lost_reports.acknowledged(batch_id)
            self._rehand = collections.deque(b for b in self._rehand if b[0] != batch_id)
            self.delivered_seqs += sum(g.n_seqs for g in groups)
        if told_count is not None:  # a save that fails is logged: those ids are named again after a restart
            try:
                self.store.save_lost_told(told_count)
            except (OSError, StateFileError) as exc:
                log.warning("could not save which lost groups the trainer was told of: %s", exc)
        return result

    def trainer_restarted(self) -> tuple[int, int]:
        """A (re)registering trainer: a new session, newer than every earlier one (the clock's
        microseconds) and saved before this returns, and every unacknowledged batch handed out
        again first. Returns the session and how many batches. From now on a call that carries an
        older session is refused (:meth:`check_trainer`): a second live trainer, or the old
        process of a restarted one, cannot take batches the new one is owed."""
        with self._pull_lock:
            with self._lock:
                session = max(self._trainer_session + 1, int(self.clock() * 1_000_000))
            self.store.save_trainer_session(session)  # StoreUnavailableError: nothing changed
            with self._lock:
                self._trainer_session = session
                self._trainer_heard_s = self.clock()
                self._trainer_steps.abandon()
                self.in_use = True
                self._rehand = collections.deque((b, g) for b, g in self._handed.items())
                return session, len(self._rehand)

    def check_trainer(self, session: int | None) -> None:
        """TrainerSuperseded if ``session`` is older than the newest registration's,
        TrainerSessionUnknown if it is newer (never issued); a caller that sends none (the raw
        API) is not checked."""
        with self._lock:
            newest = self._trainer_session
        if session is not None and session < newest:
            raise TrainerSuperseded(session, newest)
        if session is not None and session > newest:
            raise TrainerSessionUnknown(session, newest)

    def set_version(self, version: int, recovered: bool = False, session: int | None = None) -> None:
        """The trainer's policy version. Plain: not lower than the current one and at most
        max_staleness + 1 past it, else :class:`VersionRefused`. ``recovered``: the trainer resumed
        from a checkpoint at ``version``; the accepted count is anchored there, plus what is
        still buffered (it will be trained on first). TrainerSuperseded for a ``session``
        older than the newest."""
        self.check_trainer(session)
        self._trainer_heard_s = self.clock()
        self.book.set_version(version, recovered, self._buffered_seqs)

    # ---- numbers -----------------------------------------------------------------------------
    def snapshot(self) -> QueueSnapshot | None:
        """What the autoscaler takes (None until the queue is in use); releases expired leases."""
        now_s = self.clock()
        with self._lock:
            self.leases.expire(now_s)
            if not self.in_use:
                return None
            return QueueSnapshot(
                self._queued.seqs, self.config.batch_size, self._pulls.rate(now_s), self._accepts.rate(now_s),
                self.staleness.running, self.config.max_staleness, self.staleness.capacity(),
                self.config.capacity_seqs, self._trainer_steps.step_s(now_s), self._trainer_steps.waiting(),
                round(self._accepts.total(now_s)), self._trainer_steps.latest_step_s(now_s))

    def stats(self) -> dict[str, Any]:
        now_s = self.clock()
        with self._lock:
            self.leases.expire(now_s)
            return {
                "queued_sequences": self._queued.seqs, "queued_groups": len(self._queued),
                "queued_bytes": self._queued.nbytes, "capacity_sequences": self.config.capacity_seqs,
                "capacity_bytes": self.config.capacity_bytes, "batch_size": self.config.batch_size,
                "policy_version": self.staleness.version, "staleness_capacity": self.staleness.capacity(),
                "max_staleness": self.config.max_staleness, "running_rollouts": self.staleness.running,
                "delivered_sequences": self.delivered_seqs, "dropped_stale_sequences": self.dropped_stale_seqs,
                "refused_submits": self.refused_submits, "refused_stale_sequences": self.refused_stale_seqs,
                "unacked_batches": len(self._handed),
                "lost_groups": self.lost_groups, "lost_sequences": self.lost_seqs,
                "consumption_seqs_per_s": self._pulls.rate(now_s), "production_seqs_per_s": self._accepts.rate(now_s),
                "trainer_step_s": self._trainer_steps.step_s(now_s),
                "trainer_wait_fraction": self._trainer_steps.wait_fraction(now_s),
                "trainer_last_call_s_ago": None if self._trainer_heard_s is None else round(now_s - self._trainer_heard_s, 1),
            }


def _log_ahead(where: str, ahead: list[StoredGroup], version: int) -> None:
    """Say which groups were dropped as made past the version a trainer resumed at."""
    if ahead:
        log.warning("dropped %d %s sequences (%d groups) made at versions %d..%d, past version %d the trainer "
                    "resumed at: their weights are from the run it went back from", sum(g.n_seqs for g in ahead),
                    where, len(ahead), min(g.version for g in ahead), max(g.version for g in ahead), version)
