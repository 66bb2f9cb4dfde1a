"""The rollout queue's staleness counts, kept exactly across controller restarts.

AReaL's capacity (:class:`~slurm_elastic.core.staleness.StalenessManager`) and the workers'
admission leases (:class:`~slurm_elastic.core.staleness.AdmissionLeases`), moved by the queue's
arrivals, drops and losses, by stale groups refused and by the trainer's versions. Every
admission, version change and stale refusal is saved to the store
(:class:`~slurm_elastic.core.staleness_snapshot.StalenessSnapshot`: the version, the accepted count plus
the sequences freed, the leases, and the arrival number they are current up to) before it is
answered; at a restart the groups stored after that arrival number move the counts on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from slurm_elastic.core.staleness import AdmissionLeases, StalenessManager
from slurm_elastic.core.staleness_snapshot import StalenessSnapshot
from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.storage import Recovered, RolloutStorage

log = logging.getLogger(__name__)


class StalenessBook:
    """The counts of one queue. They move with the queue's contents, so they share its lock
    (``lock``): the methods marked "lock held" are called with it held; :meth:`admit` and
    :meth:`set_version` take it themselves, and save the counts outside it."""

    def __init__(self, store: RolloutStorage, lock: threading.Lock, batch_size: int, max_staleness: int,
                 max_concurrent: int, admission_ttl_s: float) -> None:
        self.store = store
        self.lock = lock
        self.staleness = StalenessManager(batch_size, max_staleness, max_concurrent)
        self.leases = AdmissionLeases(self.staleness, admission_ttl_s)
        self.freed_seqs = 0  # accepted, never to be consumed: dropped as stale or lost to damage
        self.last_seq = 0  # the highest arrival number the counts account for
        self._save_lock = threading.Lock()  # one save at a time, each newer than the last
        self._changes = 0  # admissions and version changes made ...
        self._saved_changes = 0  # ... and how many of them the saved counts hold
        self._publishes = 0  # version publishes made
        self._told_of_repeats: set[str] = set()  # workers warned that a repeat is not granted again

    def recover(self, recovered: Recovered, freed_seqs: int, now_s: float) -> None:
        """The counts as saved last, moved on by the groups stored since and the sequences
        freed in all (``freed_seqs``). Saved counts that give impossible ones (damage SQLite does
        not see) are refused with :class:`StateFileError`, as unreadable ones are: nothing is
        restored, and nothing saved over them."""
        saved = recovered.staleness or StalenessSnapshot(0, 0, 0, {})
        buffered = sum(g.n_seqs for g in recovered.queued)
        buffered += sum(g.n_seqs for _batch, groups in recovered.unacked for g in groups)
        try:
            saved.restore(self.leases, recovered.arrived_after_snapshot, freed_seqs, buffered, recovered.last_seq)
        except ValueError as exc:
            raise StateFileError(
                f"rollout store: its saved staleness counts (version {saved.version}, gross_seqs {saved.gross_seqs}, "
                f"at_seq {saved.at_seq}) are damaged: {exc}; opened, they would admit rollouts past the "
                "staleness bound. Restore the store's .sqlite file (with its -wal file) from a copy, or "
                "move the store aside to start with an empty queue and give its groups up") from None
        self.freed_seqs, self.last_seq = freed_seqs, recovered.last_seq
        self.leases.expire(now_s)

    def admit(self, worker_id: str, n_seqs: int, now_s: float, admission_id: str = "", whole: bool = False) -> int:
        """How many of ``n_seqs`` ``worker_id`` may start now; they are its lease, saved before
        this returns (taken back if the save fails, unless a save beside it kept them). A repeat of
        one of the worker's recent ``admission_id``s is answered what that one was granted once
        that grant is saved, and granted nothing more (:class:`~slurm_elastic.core.staleness.Lease`)."""
        with self.lock:
            held = self.leases.leases.get(worker_id)
            answer = held.answer(admission_id) if admission_id and held is not None else None
            if answer is not None:
                assert held is not None
                if answer > held.unused_seqs and worker_id not in self._told_of_repeats:
                    self._told_of_repeats.add(worker_id)
                    log.warning("worker %s repeated admission id %s after using what it was granted: answered, "
                                "not granted again (a request that came late, or a client that sends one id for "
                                "several asks: each ask needs its own admission_id)", worker_id, admission_id)
                if not answer:
                    return 0
                wanted = self._changes  # the grant repeated is one of these changes
            else:
                granted = self.leases.grant(worker_id, n_seqs, now_s, admission_id, whole)
                if not granted:
                    return 0
                wanted = self._changed()
        if answer is not None:
            return self._answer_again(worker_id, n_seqs, now_s, admission_id, answer, wanted, whole)
        try:
            self._save(wanted)
        except BaseException as exc:
            with self.lock:
                if isinstance(exc, Exception) and self._saved_changes >= wanted:
                    return granted  # a repeat's save, after this one failed, holds the grant
                self.leases.revoke(worker_id, granted, forget_id=admission_id)
                self._changed()
            raise
        return granted

    def _answer_again(self, worker_id: str, n_seqs: int, now_s: float, admission_id: str, answer: int,
                      wanted: int, whole: bool = False) -> int:
        """A repeat's answer once the grant it repeats is saved: its first try may still be saving
        it (a retry sent on a timeout), and what a worker is told it may start must survive a
        restart. If that save failed and the grant was taken back, the repeat is a new ask."""
        self._save(wanted)
        with self.lock:
            held = self.leases.leases.get(worker_id)
            if held is not None and held.answer(admission_id) == answer:
                return answer
        return self.admit(worker_id, n_seqs, now_s, admission_id, whole)

    def set_version(self, version: int, recovered: bool, buffered_seqs: Callable[[], int]) -> None:
        """A plain publish (checked: VersionRefused), or a resume from a checkpoint at
        ``version`` with ``buffered_seqs()`` (lock held) still to be trained on; saved, and
        taken back if the save fails (the error is raised: nothing changed), unless a save beside
        it held it or a publish came after it (a trainer's retry: its own save decides)."""
        with self.lock:
            before_version, before_accepted = self.staleness.version, self.staleness.accepted
            if recovered:
                self.staleness.on_version_recovered(version, buffered_seqs())
            else:
                self.staleness.on_version(version)
            moved_accepted = self.staleness.accepted - before_accepted
            wanted = self._changed()
            self._publishes += 1
            publish = self._publishes
        try:
            self._save(wanted)
        except BaseException as exc:  # a publish that was not saved did not happen: nothing may act on it
            with self.lock:
                if isinstance(exc, Exception) and self._saved_changes >= wanted:
                    return  # a save beside it, after this one failed, holds the publish
                if self._publishes == publish and self.staleness.version == version:
                    self.staleness.version = before_version
                    self.staleness.accepted -= moved_accepted
                self._changed()
            raise

    def accepted(self, worker_id: str, n_seqs: int, seq: int, now_s: float) -> None:
        """A group arrived with arrival number ``seq`` (lock held)."""
        self.last_seq = max(self.last_seq, seq)
        self.leases.accept(worker_id, n_seqs, now_s)

    def refused(self, worker_id: str, group_id: str, n_seqs: int, now_s: float) -> int | None:
        """``worker_id``'s group ``group_id`` of ``n_seqs`` sequences was refused (stale, or a
        version ahead) or given back: they leave its lease as AReaL's ``on_rollout_rejected``,
        once: a resend releases nothing again (lock held; saved, with the group's id, by the next
        :meth:`save`). Returns the sequences released; None for a resend (nothing changed)."""
        self.leases.expire(now_s)
        released = self.leases.refuse(worker_id, n_seqs, group_id)
        if released is not None:
            self._changed()
        return released

    def released(self, worker_ids: list[str]) -> int:
        """The steps of ``worker_ids`` have ended: their leases are released (saved by the next
        :meth:`save`); returns the sequences released."""
        with self.lock:
            released = sum(self.leases.release(w) for w in worker_ids)
            self._told_of_repeats.difference_update(worker_ids)
            if released:
                self._changed()
        return released

    def held(self, stopped: list[str], now_s: float) -> bool:
        """The workers whose steps stand stopped now (a suspended job): their leases stay, with no
        TTL running (saved by the next :meth:`save`); returns whether that changed."""
        with self.lock:
            changed = self.leases.hold(stopped, now_s)
            if changed:
                self._changed()
        return changed

    def save(self) -> None:
        """Save the counts unless the last save holds every change made so far."""
        with self.lock:
            wanted = self._changes
        self._save(wanted)

    def freed(self, n_seqs: int) -> None:
        """Accepted sequences that will never be consumed (dropped, lost): they hold no capacity
        (lock held)."""
        self.freed_seqs += n_seqs
        self.staleness.on_dropped(n_seqs)

    def _changed(self) -> int:
        self._changes += 1
        return self._changes

    def _save(self, wanted: int) -> None:
        """Save the counts as they are now, unless a save since change ``wanted`` holds them
        already (concurrent admissions share one write)."""
        with self._save_lock:
            if self._saved_changes >= wanted:
                return
            with self.lock:
                snapshot = StalenessSnapshot.take(self.leases, self.freed_seqs, self.last_seq)
                changes = self._changes
            self.store.save_staleness(snapshot)
            self._saved_changes = changes
