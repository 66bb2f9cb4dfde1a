"""The bounded rollout queue: sequences in memory as small records, payloads on disk.

The workers' side is here: submits past the capacity (sequences or bytes) are refused with a
retry-after hint, and so are groups already too stale or of a version the trainer has not
reached (nothing stored). The trainer's side, batches handed out until acknowledged, is a
:class:`~slurm_elastic.rollouts.handout.BatchHandout` that shares the queue's lock and groups;
the queue answers for both.

The queue keeps its groups through a :class:`~slurm_elastic.rollouts.storage.RolloutStorage`
and its staleness counts in a :class:`~slurm_elastic.rollouts.admissions.StalenessBook`; both
survive a controller restart exactly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from slurm_elastic.core.pressure import QueueSnapshot
from slurm_elastic.core.rates import PRODUCTION_WINDOW_S, GroupSizes, WindowRate
from slurm_elastic.core.staleness import AdmissionLeases, StalenessManager, VersionRefused, is_stale
from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.admissions import StalenessBook
from slurm_elastic.rollouts.config import QueueConfig
from slurm_elastic.rollouts.handout import BatchHandout
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
from slurm_elastic.rollouts.storage import RolloutStorage, StoredGroup, Then, settle

__all__ = ["GroupRefused", "QueueConfig", "QueueFull", "RolloutQueue", "StaleGroup", "TrainerSessionRefused",
           "TrainerSessionUnknown", "TrainerSuperseded", "UnknownBatchError", "VersionAhead", "VersionRefused"]
log = logging.getLogger(__name__)


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
        self.refused_submits = 0
        self.refused_stale_seqs = 0  # in groups refused at submit for their policy version (this run)
        self._stored_any = False  # rollouts arrived (in this run or an earlier one)
        self._accepts = WindowRate(PRODUCTION_WINDOW_S)
        self._group_sizes = GroupSizes()
        self.book = StalenessBook(store, self._lock, config.batch_size, config.max_staleness, config.max_concurrent,
                                  config.admission_ttl_s)
        self.trainer = BatchHandout(store, config, clock, self._lock, self._queued, self.book)
        self._recover()

    @property
    def staleness(self) -> StalenessManager:
        return self.book.staleness

    @property
    def leases(self) -> AdmissionLeases:
        return self.book.leases

    @property
    def in_use(self) -> bool:
        """A trainer registered or pulled, or rollouts arrived: the buffer means something."""
        return self._stored_any or self.trainer.used

    def _recover(self) -> None:
        recovered = self.store.recover()
        for group in recovered.queued:
            self._queued.append(group)
        self._stored_any = bool(recovered.seqs_by_state)
        self.trainer.recover(recovered)
        self.book.recover(recovered, self.trainer.dropped_stale_seqs + self.trainer.lost_seqs, self.clock())

    # ---- workers -----------------------------------------------------------------------------
    def admit(self, n_seqs: int, worker_id: str, admission_id: str = "", whole: bool = False) -> int:
        """The capacity gate: how many of ``n_seqs`` ``worker_id`` may start now (staleness and
        concurrency; ``whole``: all or none); they are its lease, recorded durably before this
        returns. A retry with the same ``admission_id`` (its answer lost) gets the same grant,
        granted once."""
        with self._lock:
            self._group_sizes.asked(n_seqs)
        return self.book.admit(worker_id, n_seqs, self.clock(), admission_id, whole)

    def most_at_once(self) -> int:
        """The most sequences that may run at once in a steady run: ``max_concurrent``, and
        (``max_staleness`` + 1) batches (the staleness window, less what is buffered). An ask
        for all of more than this (``whole``) waits until the trainer's versions run ahead of
        its batches, if ever (the SDK warns)."""
        cfg = self.config
        return min(cfg.max_concurrent, (cfg.max_staleness + 1) * cfg.batch_size)

    def give_back(self, n_seqs: int, worker_id: str, release_id: str) -> int:
        """``worker_id`` will not submit ``n_seqs`` of what it was admitted (a rollout that
        failed): released from its lease (AReaL's ``on_rollout_rejected``), at most what the
        lease holds, once per ``release_id`` (a retry releases nothing again); saved before this
        returns. Returns the sequences released."""
        with self._lock:
            released = self.book.refused(worker_id, release_id, n_seqs, self.clock())
        if released is not None:  # its id, too, is saved before the answer: a retry after a restart
            self.save_counts()  # and a new grant must release nothing
        return released or 0

    def release_leases(self, worker_ids: list[str]) -> int:
        """The steps of ``worker_ids`` have ended (failed, drained, cancelled, or now a
        placeholder): what their leases hold is released and saved (a save that fails is logged and
        made by the next admission); returns the sequences released. A late submit of theirs is
        accepted as unadmitted."""
        released = self.book.released(worker_ids) if worker_ids else 0
        if released:
            self.save_counts()
        return released

    def hold_leases(self, stopped: list[str]) -> None:
        """The workers whose steps stand stopped now with their suspended job: their leases stay
        counted in flight, and the admission TTL (for workers that hang) does not run for them,
        across a restart too (saved); one that leaves the set (resumed) has a whole TTL from now."""
        if self.book.held(stopped, self.clock()):
            self.save_counts()

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
                self.book.refused(worker_id, group_id, n_seqs, self.clock())  # on_rollout_rejected (saved by save_counts)
                if isinstance(refusal, StaleGroup):
                    self.refused_stale_seqs += n_seqs
                try:
                    raise refusal
                finally:  # the refusal's traceback holds this frame: naming the refusal in it would
                    del refusal  # be a cycle, which keeps ``payload`` until a rare cyclic collection
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
                try:
                    raise full
                finally:  # as above
                    del full
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
                    self._stored_any = True
                    now_s = self.clock()
                    self.book.accepted(worker_id, n_seqs, seq, now_s)
                    self._accepts.add(now_s, n_seqs)
                    self._group_sizes.add(n_seqs)
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
        rate = self.trainer.pulls.rate(self.clock())
        return 1.0 if not rate else max(0.1, min(30.0, self.config.batch_size / rate))

    # ---- trainer (BatchHandout) ---------------------------------------------------------------
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
        return self.trainer.pull(pull_id, session)

    def lost_ids_for(self, batch_id: str) -> list[str]:
        """The quarantined group ids to tell with batch ``batch_id``: those told with it before
        (a retry of its pull, or the batch handed out again) and those quarantined since; told
        again with it until it is acknowledged, so a lost answer loses none of them."""
        return self.trainer.lost_ids_for(batch_id)

    def ack(self, batch_id: str, session: int | None = None) -> bool:
        """The trainer consumed a batch. Idempotent; raises UnknownBatchError for an unknown id,
        TrainerSuperseded for a ``session`` older than the newest (TrainerSessionUnknown: newer)."""
        return self.trainer.ack(batch_id, session)

    def trainer_restarted(self) -> tuple[int, int]:
        """A (re)registering trainer: a new session, newer than every earlier one (the clock's
        microseconds) and saved before this returns, and every unacknowledged batch handed out
        again first. Returns the session and how many batches. From now on a call that carries an
        older session is refused (:meth:`check_trainer`): a second live trainer, or the old
        process of a restarted one, cannot take batches the new one is owed."""
        return self.trainer.trainer_restarted()

    def check_trainer(self, session: int | None) -> None:
        """TrainerSuperseded if ``session`` is older than the newest registration's,
        TrainerSessionUnknown if it is newer (never issued); a caller that sends none (the raw
        API) is not checked."""
        self.trainer.check_trainer(session)

    def set_version(self, version: int, recovered: bool = False, session: int | None = None) -> None:
        """The trainer's policy version. Plain: not lower than the current one and at most
        max_staleness + 1 past it, else :class:`VersionRefused`. ``recovered``: the trainer resumed
        from a checkpoint at ``version``; the accepted count is anchored there, plus what is
        still buffered (it will be trained on first). TrainerSuperseded for a ``session``
        older than the newest."""
        self.trainer.set_version(version, recovered, session)

    # ---- numbers -----------------------------------------------------------------------------
    def snapshot(self) -> QueueSnapshot | None:
        """What the autoscaler takes (None until the queue is in use); releases expired leases."""
        now_s, steps = self.clock(), self.trainer.steps
        with self._lock:
            self.leases.expire(now_s)
            if not self.in_use:
                return None
            return QueueSnapshot(
                self._queued.seqs, self.config.batch_size, self.trainer.pulls.rate(now_s), self._accepts.rate(now_s),
                self.staleness.running, self.config.max_staleness, self.staleness.capacity(),
                self.config.capacity_seqs, steps.step_s(now_s), steps.waiting(),
                round(self._accepts.total(now_s)), steps.latest_step_s(now_s), self._group_sizes.smallest())

    def stats(self) -> dict[str, Any]:
        now_s, trainer = self.clock(), self.trainer
        with self._lock:
            self.leases.expire(now_s)
            return {
                "queued_sequences": self._queued.seqs, "queued_groups": len(self._queued),
                "queued_bytes": self._queued.nbytes, "capacity_sequences": self.config.capacity_seqs,
                "capacity_bytes": self.config.capacity_bytes, "batch_size": self.config.batch_size,
                "policy_version": self.staleness.version, "staleness_capacity": self.staleness.capacity(),
                "max_staleness": self.config.max_staleness, "running_rollouts": self.staleness.running,
                "delivered_sequences": trainer.delivered_seqs, "dropped_stale_sequences": trainer.dropped_stale_seqs,
                "refused_submits": self.refused_submits, "refused_stale_sequences": self.refused_stale_seqs,
                "unacked_batches": trainer.unacked_batches,
                "lost_groups": trainer.lost_groups, "lost_sequences": trainer.lost_seqs,
                "consumption_seqs_per_s": trainer.pulls.rate(now_s), "production_seqs_per_s": self._accepts.rate(now_s),
                "trainer_step_s": trainer.steps.step_s(now_s),
                "trainer_wait_fraction": trainer.steps.wait_fraction(now_s),
                "trainer_last_call_s_ago": None if trainer.heard_s is None else round(now_s - trainer.heard_s, 1),
            }
