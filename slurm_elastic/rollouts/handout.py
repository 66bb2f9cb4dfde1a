"""The trainer's side of the rollout queue: batches packed from the queued groups and handed out,
handed out again until acknowledged, the trainer's sessions, and its pace.

The trainer pulls batches of exactly ``batch_size`` sequences made of whole groups, the oldest
that make one within a bounded look-ahead (:mod:`.packing`); groups older than the staleness bound
when it pulls, or made past the version it resumed at from an earlier checkpoint (also out of a
batch handed out again), are dropped and counted. Unacknowledged batches are handed out again
(same id, same content) after a restart of the trainer or of the controller, and to a pull that
repeats the ``pull_id`` of the one that got it (a retry after a lost answer).

:class:`~slurm_elastic.rollouts.queue.RolloutQueue` builds it and shares with it its lock, its
queued groups, its store and its staleness book.
"""

from __future__ import annotations

import collections
import logging
import threading
import uuid
from collections.abc import Callable

from slurm_elastic.core.rates import CONSUMPTION_WINDOW_S, TrainerSteps, WindowRate
from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.admissions import StalenessBook
from slurm_elastic.rollouts.config import QueueConfig
from slurm_elastic.rollouts.lost_reports import LostReports
from slurm_elastic.rollouts.queued import QueuedGroups
from slurm_elastic.rollouts.refusals import (
    TrainerSessionUnknown,
    TrainerSuperseded,
    UnknownBatchError,
)
from slurm_elastic.rollouts.storage import LostGroup, Recovered, RolloutStorage, StoredGroup

log = logging.getLogger(__name__)
PULL_IDS_KEPT = 1024  # pull ids remembered (with their batch) for retries of those pulls
UNPACKABLE_WARN_S = 60.0  # a batch-sized queue no whole groups pack into exactly: warned after this, and each this long
Batch = tuple[str, list[bytes]]  # (batch id, group payloads)


class BatchHandout:
    """Batches for the trainer, thread-safe under the queue's lock (and one pull at a time)."""

    def __init__(self, store: RolloutStorage, config: QueueConfig, clock: Callable[[], float],
                 lock: threading.Lock, queued: QueuedGroups, book: StalenessBook) -> None:
        self.store, self.config, self.clock = store, config, clock
        self._lock, self._queued, self.book = lock, queued, book
        self._pull_lock = threading.Lock()  # one pull at a time: a retry waits for the pull it repeats
        self._handed: dict[str, list[StoredGroup]] = {}  # unacknowledged batches and their groups
        self._rehand: collections.deque[str] = collections.deque()  # to hand out again first, in order
        self._pull_ids: collections.OrderedDict[str, str] = collections.OrderedDict()  # pull id -> its batch
        self.delivered_seqs = 0
        self.dropped_stale_seqs = 0
        self.lost_groups = 0  # quarantined: their records in the log were damaged
        self.lost_seqs = 0
        self._lost_reports = LostReports([], 0)  # which lost groups the trainer was told of
        self._trainer_session = 0  # the newest trainer registration's session (saved; 0: none yet)
        self.used = False  # a trainer registered or pulled
        self.pulls = WindowRate(CONSUMPTION_WINDOW_S)
        self.steps = TrainerSteps()  # the trainer's compute per batch and its waits, from its calls
        self.heard_s: float | None = None  # the trainer's last call (register, pull, ack, version)
        self._unpackable_since_s: float | None = None  # pulls found a batch's worth queued and packed none
        self._unpackable_warned_s = float("-inf")

    def recover(self, recovered: Recovered) -> None:
        """Take what a controller before this one left: unacknowledged batches (handed out again
        first), the lost groups, the counts and the newest trainer session."""
        for batch_id, groups in recovered.unacked:
            self._rehand.append(batch_id)
            self._handed[batch_id] = groups
        self.lost_groups, self.lost_seqs = len(recovered.lost), sum(g.n_seqs for g in recovered.lost)
        self._lost_reports = LostReports([g.id for g in recovered.lost], recovered.lost_told)
        self.delivered_seqs = recovered.seqs_by_state.get("delivered", 0)
        self.dropped_stale_seqs = recovered.seqs_by_state.get("dropped", 0)
        self._trainer_session = recovered.trainer_session

    def buffered_seqs(self) -> int:
        """Sequences the trainer will still get (lock held): queued, or handed out and not acknowledged."""
        return self._queued.seqs + sum(g.n_seqs for groups in self._handed.values() for g in groups)

    @property
    def unacked_batches(self) -> int:
        return len(self._handed)

    def pull(self, pull_id: str | None = None, session: int | None = None) -> Batch | None:
        """See :meth:`RolloutQueue.pull <slurm_elastic.rollouts.queue.RolloutQueue.pull>`."""
        with self._pull_lock:
            self.check_trainer(session)
            with self._lock:
                self.used = True
                self.heard_s = self.clock()
                earlier = self._pull_ids.get(pull_id) if pull_id is not None else None
                if earlier is None:  # (a retry of a pull that got a batch is no new ask)
                    self.steps.asked(self.heard_s)
                elif earlier not in self._handed:
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
                    self._rehand = collections.deque(b for b in self._rehand if b != batch[0])
                    self._pull_ids[pull_id] = batch[0]
                    self._pull_ids.move_to_end(pull_id)
                    if len(self._pull_ids) > PULL_IDS_KEPT:
                        self._pull_ids.popitem(last=False)
            return batch

    def _pull_fresh(self) -> Batch | None:
        """A batch waiting to be handed out again, else a new one."""
        while True:
            with self._lock:
                rehand = self._rehand.popleft() if self._rehand else None
            if rehand is None:
                return self._pull_new()
            batch = self._hand_again(rehand, requeue=True)
            if batch is not None:
                return batch

    def _pull_new(self) -> Batch | None:
        """A new batch packed from the queue, its hand-out recorded."""
        while True:
            with self._lock:
                self._drop_untrainable()
                chosen = self._queued.take_batch(self.config.batch_size, self.config.lookahead_groups)
                self._watch_packing(chosen is None)
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
                self.pulls.add(self.clock(), self.config.batch_size)
                self.steps.served(self.clock(), batch_id)
            return batch_id, pulled.payloads

    def _watch_packing(self, packed_none: bool) -> None:
        """Warn (once a minute, after a minute) while pulls find at least a batch's worth queued
        and no whole groups that make exactly ``batch_size``: group sizes that can never add up
        to it stall the trainer with a full-looking buffer (lock held)."""
        batch_size = self.config.batch_size
        if not packed_none or self._queued.seqs < batch_size:
            self._unpackable_since_s = None
            return
        now_s = self.clock()
        self._unpackable_since_s = self._unpackable_since_s if self._unpackable_since_s is not None else now_s
        if now_s - self._unpackable_since_s < UNPACKABLE_WARN_S or now_s - self._unpackable_warned_s < UNPACKABLE_WARN_S:
            return
        self._unpackable_warned_s = now_s
        sizes = ", ".join(f"{n} x {size}" for size, n in sorted(self._queued.size_counts().items()))
        log.warning("%d sequences have been queued for %.0f s, more than a batch of %d, but no whole groups among "
                    "them add up to exactly %d (groups queued: %s): the trainer gets no batch until groups that "
                    "complete one arrive; workers whose group sizes divide queue.batch_size always complete one",
                    self._queued.seqs, now_s - self._unpackable_since_s, batch_size, batch_size, sizes)

    def _hand_again(self, batch_id: str, requeue: bool) -> Batch | None:
        """An unacknowledged batch, again: its groups checked, the damaged ones quarantined.
        None if every group of it was lost (it is acknowledged then: nothing is left of it).
        ``requeue``: handed out again to a new trainer (not to a retried pull, which had it: its step
        goes on); if the store fails, it is first to be handed out again. Its groups made past
        the version the trainer resumed at since are dropped first (:meth:`_drop_ahead`)."""
        try:
            self._drop_ahead(batch_id)
            pulled = self.store.pull_again(batch_id)
            if pulled.lost:
                self._lost(pulled.lost, queued=False)
        except BaseException:
            with self._lock:
                if requeue and batch_id in self._handed:
                    self._rehand.appendleft(batch_id)
            raise
        if not pulled.payloads:
            self.ack(batch_id)
            return None
        if requeue:  # handed out again (not to a retried pull, which got it already)
            with self._lock:
                self.steps.served(self.clock(), batch_id, fresh=False)
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
        """See :meth:`RolloutQueue.lost_ids_for <slurm_elastic.rollouts.queue.RolloutQueue.lost_ids_for>`."""
        with self._lock:
            return self._lost_reports.ids_for(batch_id, batch_id in self._handed)

    def _drop_untrainable(self) -> None:
        """Drop every queued group the trainer cannot train on at its version, wherever it sits
        in the queue (lock held): older than the bound, or made past the version it resumed at
        from an earlier checkpoint (a submit of one now is refused as ahead). Counted as dropped."""
        version = self.book.staleness.version
        untrainable = self._queued.untrainable(version, self.config.max_staleness)
        if untrainable:
            self._drop(untrainable)
            self._queued.drop(untrainable)
            _log_ahead("queued", [g for g in untrainable if g.version > version], version)

    def _drop_ahead(self, batch_id: str) -> None:
        """Drop the groups of an unacknowledged batch made past the trainer's version (it resumed
        at an earlier checkpoint since the batch was handed out); the batch keeps its id."""
        with self._lock:
            version = self.book.staleness.version
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
        """See :meth:`RolloutQueue.ack <slurm_elastic.rollouts.queue.RolloutQueue.ack>`."""
        self.check_trainer(session)
        self.heard_s = self.clock()
        result = self.store.ack(batch_id)
        if result is None:
            raise UnknownBatchError(batch_id)
        if not result:  # acknowledged already: the ack that did it settles the batch here, once
            return result
        with self._lock:
            groups = self._handed.pop(batch_id, [])
            told_count = self._lost_reports.acknowledged(batch_id)
            self._rehand = collections.deque(b for b in self._rehand if b != batch_id)
            self.delivered_seqs += sum(g.n_seqs for g in groups)
            self.steps.acked(self.clock(), batch_id)
        if told_count is not None:  # a save that fails is logged: those ids are named again after a restart
            try:
                self.store.save_lost_told(told_count)
            except (OSError, StateFileError) as exc:
                log.warning("could not save which lost groups the trainer was told of: %s", exc)
        return result

    def trainer_restarted(self) -> tuple[int, int]:
        """See :meth:`RolloutQueue.trainer_restarted <slurm_elastic.rollouts.queue.RolloutQueue.trainer_restarted>`."""
        with self._pull_lock:
            with self._lock:
                session = max(self._trainer_session + 1, int(self.clock() * 1_000_000))
            self.store.save_trainer_session(session)  # StoreUnavailableError: nothing changed
            with self._lock:
                self._trainer_session = session
                self.heard_s = self.clock()
                self.steps.abandon()
                self.used = True
                self._rehand = collections.deque(self._handed)
                return session, len(self._rehand)

    def check_trainer(self, session: int | None) -> None:
        """See :meth:`RolloutQueue.check_trainer <slurm_elastic.rollouts.queue.RolloutQueue.check_trainer>`."""
        with self._lock:
            newest = self._trainer_session
        if session is not None and session < newest:
            raise TrainerSuperseded(session, newest)
        if session is not None and session > newest:
            raise TrainerSessionUnknown(session, newest)

    def set_version(self, version: int, recovered: bool = False, session: int | None = None) -> None:
        """See :meth:`RolloutQueue.set_version <slurm_elastic.rollouts.queue.RolloutQueue.set_version>`."""
        self.check_trainer(session)
        self.heard_s = self.clock()
        self.book.set_version(version, recovered, self.buffered_seqs)


def _log_ahead(where: str, ahead: list[StoredGroup], version: int) -> None:
    """Say which groups were dropped as made past the version a trainer resumed at."""
    if ahead:
        log.warning("dropped %d %s sequences (%d groups) made at versions %d..%d, past version %d the trainer "
                    "resumed at: their weights are from the run it went back from", sum(g.n_seqs for g in ahead),
                    where, len(ahead), min(g.version for g in ahead), max(g.version for g in ahead), version)
