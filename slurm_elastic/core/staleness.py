"""How many rollouts may start now without breaking the staleness bound (AReaL's semantics).

    capacity = min(max_concurrent - running,
                   (max_staleness + version + 1) * batch_size - (accepted + running))

``version`` is the trainer's policy version; ``accepted`` counts sequences accepted into the
buffer (less those dropped as stale), ``running`` those admitted and not yet handed over. After
the trainer resumes from a checkpoint at version V, ``on_version_recovered(V, buffered)``
anchors ``accepted`` at V * batch_size plus what is still buffered, so the capacity is
(max_staleness + 1) * batch_size - buffered - running, not inflated by V (AReaL's class
anchors at V * batch_size too, with the buffer taken as empty). Counts are in sequences. Where this differs from AReaL's class is listed in
docs/queue.md ("Staleness: AReaL's rule and ours").

Admissions are leases held per worker (:class:`AdmissionLeases`): a worker's submit uses its
own lease only; a lease not used within ``ttl_s`` of its worker's last admission is released,
unless its worker's step stands stopped (a suspended job). What a restart needs to find the same
counts again is :mod:`slurm_elastic.core.staleness_snapshot`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

EXPIRY_SCAN_S = 1.0  # expired leases are looked for at most this often (AdmissionLeases.expire)
MAX_VERSION = 2**63 - 1  # what the store's index holds (a signed 64-bit integer)


class VersionRefused(ValueError):
    """A plain version publish that would go backwards or jump past the bound."""


def oldest_fresh_version(version: int, max_staleness: int) -> int:
    """The oldest policy version a rollout may have and still be trained on at ``version``."""
    return version - max_staleness


def is_stale(rollout_version: int, version: int, max_staleness: int) -> bool:
    """Whether a rollout generated at ``rollout_version`` is too old to train on at ``version``."""
    return rollout_version < oldest_fresh_version(version, max_staleness)


def is_untrainable(rollout_version: int, version: int, max_staleness: int) -> bool:
    """Whether a trainer at ``version`` cannot train on a rollout of ``rollout_version``: it is
    stale, or it was made past ``version`` (by the weights of a run the trainer went back from
    when it resumed from an earlier checkpoint). The drop rule, the same for the queue and the
    simulator."""
    return rollout_version > version or is_stale(rollout_version, version, max_staleness)


def max_version_step(max_staleness: int) -> int:
    """How far one plain publish may move the version: one past what makes every buffered
    rollout stale at once. A bigger jump is a resume from a checkpoint (``recovered``)."""
    return max_staleness + 1


def rollouts_at_once(max_staleness: int, batch_size: int, held_seqs: int, smallest_group_seqs: int) -> int:
    """The most rollouts the bound lets run at once: a rollout holds at least ``smallest_group_seqs``
    of the capacity while it runs, and running + capacity is at most (max_staleness + 1)·batch_size
    (the buffer empty); ``held_seqs`` (running + capacity now) where a trainer's versions ran ahead
    of its batches and left more."""
    return math.ceil(max((max_staleness + 1) * batch_size, held_seqs) / max(1, smallest_group_seqs))


@dataclass
class StalenessManager:
    batch_size: int
    max_staleness: int
    max_concurrent: int
    version: int = 0
    accepted: int = 0
    running: int = 0
    rejected: int = 0
    submitted: int = 0

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or self.max_staleness < 0 or self.max_concurrent <= 0:
            raise ValueError("batch_size and max_concurrent must be > 0 and max_staleness >= 0")

    def capacity(self) -> int:
        """Rollouts (sequences) that may start now; never negative."""
        concurrency = self.max_concurrent - self.running
        staleness = (self.max_staleness + self.version + 1) * self.batch_size - (self.accepted + self.running)
        return max(0, min(concurrency, staleness))

    def on_submitted(self, n: int = 1) -> None:
        """n rollouts were admitted and started."""
        self.submitted += n
        self.running += n

    def on_accepted(self, n: int = 1) -> None:
        """n running rollouts finished and were accepted into the buffer."""
        self.running -= n
        self.accepted += n

    def on_accepted_unadmitted(self, n: int = 1) -> None:
        """n rollouts were accepted that no open admission covered (none asked, or its lease
        expired): they hold capacity from now on, and take nothing from ``running``."""
        self.accepted += n

    def on_rejected(self, n: int = 1) -> None:
        """n admitted rollouts will not be handed over (their lease expired or was revoked)."""
        self.running -= n
        self.rejected += n

    def on_dropped(self, n: int = 1) -> None:
        """n accepted rollouts were dropped from the buffer (too stale): they will never be consumed."""
        self.accepted -= n
        self.rejected += n

    def check_version(self, version: int) -> None:
        """Raise :class:`VersionRefused` unless a plain publish of ``version`` is allowed: not
        lower than the current one, at most :func:`max_version_step` past it."""
        if not 0 <= version <= MAX_VERSION:
            raise VersionRefused(f"policy version {version} is outside 0..{MAX_VERSION}")
        if version < self.version:
            raise VersionRefused(
                f"policy version {version} is lower than the current {self.version}; a trainer that "
                f"resumed from a checkpoint publishes its version with recovered=true")
        step = max_version_step(self.max_staleness)
        if version - self.version > step:
            raise VersionRefused(
                f"policy version {version} jumps {version - self.version} past the current {self.version}; "
                f"a plain publish may advance at most max_staleness + 1 = {step} (more would drop every "
                f"buffered rollout as stale); a trainer that resumed from a checkpoint at {version} "
                f"publishes it with recovered=true")

    def on_version(self, version: int) -> None:
        """The trainer published a new policy version (checked by :meth:`check_version`)."""
        self.check_version(version)
        self.version = version

    def on_version_recovered(self, version: int, buffered_seqs: int = 0) -> None:
        """The trainer resumed from a checkpoint at ``version`` while ``buffered_seqs`` sequences
        (queued, or handed out and not acknowledged) wait for it: anchor the accepted count."""
        if not 0 <= version <= MAX_VERSION:
            raise VersionRefused(f"policy version {version} is outside 0..{MAX_VERSION}")
        self.version = version
        self.accepted = version * self.batch_size + buffered_seqs


ADMISSION_IDS_KEPT = 16  # a worker's admission ids remembered with their answers (a late repeat is answered)
REFUSED_IDS_KEPT = 16  # a worker's refused group ids remembered (a resend releases nothing again) ...
REFUSED_IDS_SAVED = 4  # ... and the last of them saved with every admission (a resend after a restart)
REFUSED_WORKERS_KEPT = 4096  # workers whose refused ids are remembered (the longest unheard of forgotten first)


@dataclass(frozen=True)
class Lease:
    """A worker's admitted sequences not yet handed over, when it was last granted any, the last
    admission id granted any with its grant (saved), and in memory its last ``ADMISSION_IDS_KEPT``
    ids with what each was granted, oldest first. A repeat of one (a retry whose answer was lost,
    or a request that arrives late) is answered the same and granted nothing more. Only the last
    id granted any is saved: a late request comes on a connection to the process that answered
    it, and a restart ends those; what a restarted controller must answer again is the last ask."""

    unused_seqs: int
    granted_at_s: float
    admission_id: str = ""
    admission_granted: int = 0
    answered: tuple[tuple[str, int], ...] = ()

    def answer(self, admission_id: str) -> int | None:
        """What ``admission_id`` was granted; None if it is not one of the ids remembered."""
        if admission_id == self.admission_id:
            return self.admission_granted
        return next((granted for known, granted in self.answered if known == admission_id), None)


@dataclass
class AdmissionLeases:
    """Admissions handed out and not yet used, per worker. A submit uses its own worker's lease
    only; what it brings beyond that lease is accepted as unadmitted. A lease is released when
    its worker's step is seen to end (:meth:`release`; a relaunch under the same id starts with
    none), and one not used within ``ttl_s`` of its worker's last admission (a worker that hangs)
    is released too. Each worker's last ``REFUSED_IDS_KEPT`` refused (or given back) group ids
    are kept apart from its lease (the last ``REFUSED_IDS_SAVED`` saved with the counts: a
    worker resends what it has in flight, a few groups at most) and forgotten when its step ends: a resend of one
    (its answer lost, a restart before the answer) releases nothing again, also when the first
    refusal found no lease (one that expired) and the resend finds a new one. Used by the queue
    and the simulator."""

    staleness: StalenessManager
    ttl_s: float
    leases: dict[str, Lease] = field(default_factory=dict)
    refused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    stopped: frozenset[str] = frozenset()  # workers whose step stands stopped (a suspended job): no TTL runs
    _oldest_s: float = field(default=math.inf, init=False, repr=False, compare=False)  # no running lease older
    _scanned_s: float = field(default=-math.inf, init=False, repr=False, compare=False)  # the last expiry scan

    def grant(self, worker_id: str, wanted: int, now_s: float, admission_id: str = "", whole: bool = False) -> int:
        """How many of ``wanted`` sequences ``worker_id`` may start now (``whole``: all of them or
        none); those are counted as running, and the lease remembers ``admission_id`` with its
        grant, a grant of none too (the queue answers a repeat of it from there: :meth:`Lease.answer`)."""
        self.expire(now_s)
        held = self.leases.get(worker_id) or Lease(0, now_s)
        granted = max(0, min(wanted, self.staleness.capacity()))
        if whole and granted < wanted:
            granted = 0
        if granted:
            self.staleness.on_submitted(granted)
            held = replace(held, unused_seqs=held.unused_seqs + granted, granted_at_s=now_s,
                           admission_id=admission_id, admission_granted=granted)
        if admission_id:
            held = replace(held, answered=(*held.answered, (admission_id, granted))[-ADMISSION_IDS_KEPT:])
        self._set(worker_id, held)
        return granted

    def revoke(self, worker_id: str, n_seqs: int, forget_id: str = "") -> None:
        """Take ``n_seqs`` back from ``worker_id``'s lease: a stale group's, or a grant that could
        not be recorded (``forget_id``: its admission id, forgotten so that a retry asks anew)."""
        held = self.leases.get(worker_id)
        if held is None:
            return
        taken = min(n_seqs, held.unused_seqs)
        self.staleness.on_rejected(taken)
        held = replace(held, unused_seqs=held.unused_seqs - taken,
                       answered=tuple(a for a in held.answered if a[0] != forget_id))
        if forget_id and held.admission_id == forget_id:
            held = replace(held, admission_id="", admission_granted=0)
        self._set(worker_id, held)

    def refuse(self, worker_id: str, n_seqs: int, group_id: str) -> int | None:
        """``worker_id``'s group ``group_id`` of ``n_seqs`` sequences was refused: what its lease
        covers of it is released (AReaL's ``on_rollout_rejected``), once per group. Returns the
        sequences released; None for a resend of a group refused before (nothing changes)."""
        seen = self.refused.pop(worker_id, ())
        self.refused[worker_id] = seen if group_id in seen else (*seen, group_id)[-REFUSED_IDS_KEPT:]
        if len(self.refused) > REFUSED_WORKERS_KEPT:
            del self.refused[next(iter(self.refused))]
        if group_id in seen:
            return None
        held = self.leases.get(worker_id)
        if held is None:
            return 0
        taken = min(n_seqs, held.unused_seqs)
        self.staleness.on_rejected(taken)
        self._set(worker_id, replace(held, unused_seqs=held.unused_seqs - taken))
        return taken

    def release(self, worker_id: str) -> int:
        """``worker_id``'s step has ended: what its lease holds will never be submitted under it
        (AReaL's ``on_rollout_rejected``); returns the sequences released."""
        self.refused.pop(worker_id, None)
        held = self.leases.pop(worker_id, None)
        if held is None:
            return 0
        self.staleness.on_rejected(held.unused_seqs)
        return held.unused_seqs

    def hold(self, stopped: Iterable[str], now_s: float) -> bool:
        """The workers whose steps stand stopped now (their job is suspended), not ended: their leases
        stay, and the TTL (for workers that hang) does not run for them; one no longer stopped (its
        job resumed) has a whole TTL from ``now_s``. Returns whether the set changed."""
        now_stopped = frozenset(stopped)
        if now_stopped == self.stopped:
            return False
        for worker_id in self.stopped - now_stopped:
            if (held := self.leases.get(worker_id)) is not None:
                self._set(worker_id, replace(held, granted_at_s=now_s))
        self.stopped = now_stopped
        return True

    def accept(self, worker_id: str, n_seqs: int, now_s: float) -> int:
        """``worker_id`` handed over ``n_seqs`` sequences; returns how many its lease covered
        (none once the lease is older than ``ttl_s``: it is released first)."""
        held = self.leases.get(worker_id)
        if held is not None and now_s - held.granted_at_s > self.ttl_s and worker_id not in self.stopped:
            self.staleness.on_rejected(self.leases.pop(worker_id).unused_seqs)
            held = None
        used = min(n_seqs, held.unused_seqs) if held else 0
        if used:
            assert held is not None
            self.staleness.on_accepted(used)
            self._set(worker_id, replace(held, unused_seqs=held.unused_seqs - used))
        if n_seqs > used:
            self.staleness.on_accepted_unadmitted(n_seqs - used)
        return used

    def expire(self, now_s: float) -> int:
        """Release every lease older than ``ttl_s``; returns the sequences released. Nothing is
        scanned while no lease is that old, and the leases are scanned at most once every
        ``EXPIRY_SCAN_S`` otherwise (a lease is released that much late at most): a client
        asking under ever new worker ids must not make every admission scan all their leases."""
        if now_s - self._oldest_s <= self.ttl_s or 0 <= now_s - self._scanned_s < EXPIRY_SCAN_S:
            return 0
        self._scanned_s = now_s
        released, self._oldest_s = 0, math.inf
        for worker_id, held in list(self.leases.items()):  # a stopped worker's lease has no TTL running
            if worker_id in self.stopped:
                continue
            if now_s - held.granted_at_s > self.ttl_s:
                released += self.leases.pop(worker_id).unused_seqs
            else:
                self._oldest_s = min(self._oldest_s, held.granted_at_s)
        if released:
            self.staleness.on_rejected(released)
        return released

    def restore(self, saved: dict[str, Lease], arrived_seqs: dict[str, int],
                refused: dict[str, tuple[str, ...]] | None = None, stopped: frozenset[str] = frozenset()) -> None:
        """After a restart: the leases as saved, less what each worker handed over since
        (``arrived_seqs``), and the refused ids and stopped workers as saved; ``running`` is what
        the leases hold."""
        self.leases, self.refused, self.stopped = {}, dict(refused or {}), stopped
        for worker_id, held in saved.items():
            self._set(worker_id, replace(held, unused_seqs=max(0, held.unused_seqs - arrived_seqs.get(worker_id, 0))))
        self.staleness.running = sum(held.unused_seqs for held in self.leases.values())
        self._oldest_s = min((h.granted_at_s for w, h in self.leases.items() if w not in stopped), default=math.inf)

    def _set(self, worker_id: str, lease: Lease) -> None:
        """Keep ``lease`` while it holds sequences or admission ids to answer repeats of."""
        if lease.unused_seqs > 0 or lease.admission_id or lease.answered:
            self.leases[worker_id] = lease
            self._oldest_s = min(self._oldest_s, lease.granted_at_s)
        else:
            self.leases.pop(worker_id, None)
