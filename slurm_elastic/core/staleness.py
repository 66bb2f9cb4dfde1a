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
own lease only; a lease not used within ``ttl_s`` of its worker's last admission is released.
:class:`StalenessSnapshot` is what a restart needs to find the same counts again.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

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
    _oldest_s: float = field(default=math.inf, init=False, repr=False, compare=False)  # no lease older
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

    def accept(self, worker_id: str, n_seqs: int, now_s: float) -> int:
        """``worker_id`` handed over ``n_seqs`` sequences; returns how many its lease covered
        (none once the lease is older than ``ttl_s``: it is released first)."""
        held = self.leases.get(worker_id)
        if held is not None and now_s - held.granted_at_s > self.ttl_s:
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
        released = 0
        for worker_id in [w for w, held in self.leases.items() if now_s - held.granted_at_s > self.ttl_s]:
            released += self.leases.pop(worker_id).unused_seqs
        self._oldest_s = min((held.granted_at_s for held in self.leases.values()), default=math.inf)
        if released:
            self.staleness.on_rejected(released)
        return released

    def restore(self, saved: dict[str, Lease], arrived_seqs: dict[str, int],
                refused: dict[str, tuple[str, ...]] | None = None) -> None:
        """After a restart: the leases as saved, less what each worker handed over since
        (``arrived_seqs``), and the refused ids as saved; ``running`` is what the leases hold."""
        self.leases, self.refused = {}, dict(refused or {})
        for worker_id, held in saved.items():
            self._set(worker_id, replace(held, unused_seqs=max(0, held.unused_seqs - arrived_seqs.get(worker_id, 0))))
        self.staleness.running = sum(held.unused_seqs for held in self.leases.values())
        self._oldest_s = min((held.granted_at_s for held in self.leases.values()), default=math.inf)

    def _set(self, worker_id: str, lease: Lease) -> None:
        """Keep ``lease`` while it holds sequences or admission ids to answer repeats of."""
        if lease.unused_seqs > 0 or lease.admission_id or lease.answered:
            self.leases[worker_id] = lease
            self._oldest_s = min(self._oldest_s, lease.granted_at_s)
        else:
            self.leases.pop(worker_id, None)


@dataclass(frozen=True)
class StalenessSnapshot:
    """What the queue stores so that its counts survive a restart exactly: the version, the
    accepted count plus the dropped total (a sum only arrivals move), the leases, and the
    arrival number of the last group accounted for, and each worker's refused group ids.
    Groups that arrived after it, and the dropped total, are the store's to tell at the restart
    (:meth:`restore`)."""

    version: int
    gross_seqs: int
    at_seq: int
    leases: dict[str, Lease]
    refused: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def take(cls, leases: AdmissionLeases, dropped_seqs: int, at_seq: int) -> StalenessSnapshot:
        staleness = leases.staleness
        return cls(staleness.version, staleness.accepted + dropped_seqs, at_seq, dict(leases.leases),
                   dict(leases.refused))

    def restore(self, leases: AdmissionLeases, arrived_seqs: dict[str, int], dropped_seqs: int,
                buffered_seqs: int = 0, last_seq: int | None = None) -> None:
        """Set ``leases`` and its manager to the counts after ``arrived_seqs`` (per worker, the
        groups after ``at_seq``) arrived, with ``dropped_seqs`` dropped in all. Raises ValueError,
        changing nothing, when those counts are impossible for a store with ``buffered_seqs``
        queued or handed out and not acknowledged and ``last_seq`` its highest arrival number
        (:meth:`damage`): they would open as a capacity above the bound."""
        damage = self.damage(arrived_seqs, dropped_seqs, buffered_seqs, last_seq)
        if damage:
            raise ValueError("; ".join(damage))
        leases.staleness.version = self.version
        leases.staleness.accepted = self.gross_seqs + sum(arrived_seqs.values()) - dropped_seqs
        leases.restore(self.leases, arrived_seqs, self.refused)

    def damage(self, arrived_seqs: dict[str, int], dropped_seqs: int, buffered_seqs: int,
               last_seq: int | None) -> list[str]:
        """Why the counts :meth:`restore` would give are impossible; empty if they are not. Every
        buffered sequence was accepted and not freed, and beyond them only acknowledged ones (or
        V·batch_size at a resume at V) are counted, so ``accepted`` is at least ``buffered_seqs``;
        with no lease below 0 the capacity is then at most AReaL's formula with the buffer
        counted. ``at_seq`` is an arrival the store holds."""
        found = []
        arrived = sum(arrived_seqs.values())
        accepted = self.gross_seqs + arrived - dropped_seqs
        if accepted < max(0, buffered_seqs):
            below = f"the {buffered_seqs} sequences still buffered (queued, or handed out and not acknowledged)"
            found.append(f"gross_seqs {self.gross_seqs} + {arrived} arrived since - {dropped_seqs} dropped or lost "
                         f"gives accepted {accepted}, below {below if accepted >= 0 else 0}")
        found += [f"the lease of {w} holds {held.unused_seqs} (running below 0)"
                  for w, held in self.leases.items() if held.unused_seqs < 0]
        if self.version > MAX_VERSION:
            found.append(f"version {self.version} is past {MAX_VERSION}")
        if last_seq is not None and self.at_seq > last_seq:
            found.append(f"at_seq {self.at_seq} is past the last arrival stored, {last_seq}")
        return found

    def to_json(self) -> str:
        leases = {w: [h.unused_seqs, h.granted_at_s, h.admission_id, h.admission_granted]
                  for w, h in self.leases.items() if h.unused_seqs or h.admission_id}
        refused = {"refused": {w: list(ids[-REFUSED_IDS_SAVED:]) for w, ids in self.refused.items()}} \
            if self.refused else {}
        return json.dumps({"version": self.version, "gross_seqs": self.gross_seqs, "at_seq": self.at_seq,
                           "leases": leases, **refused}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> StalenessSnapshot:
        """Raises ValueError for anything but what :meth:`to_json` writes (negative counts included:
        no queue ever saves one)."""
        try:
            data: Any = json.loads(text)
            leases = {str(w): _lease(held) for w, held in data["leases"].items()}
            refused = {str(w): _refused_ids(ids) for w, ids in data.get("refused", {}).items()}
            for w, held in data["leases"].items():  # the last refused id, as the lease's 5th item (an earlier form)
                if isinstance(held, list) and len(held) == 5 and str(w) not in refused:
                    refused[str(w)] = (str(held[4]),)
            snapshot = cls(int(data["version"]), int(data["gross_seqs"]), int(data["at_seq"]), leases, refused)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a staleness snapshot: {exc}") from None
        negative = [name for name, value in (("version", snapshot.version), ("gross_seqs", snapshot.gross_seqs),
                                              ("at_seq", snapshot.at_seq)) if value < 0]
        negative += [f"lease of {w}" for w, held in leases.items() if held.unused_seqs < 0 or held.admission_granted < 0]
        if negative:
            raise ValueError(f"not a staleness snapshot: negative {', '.join(negative)}")
        return snapshot


def _lease(saved: Any) -> Lease:
    """A lease as :meth:`StalenessSnapshot.to_json` writes it: [unused, granted at, the last
    admission id granted any, its grant], or [unused, granted at] (written before admissions had
    ids); a 5th item, the last group refused, was written before the refused ids were saved apart."""
    if not isinstance(saved, list) or len(saved) not in (2, 4, 5):
        raise TypeError(f"a lease is [unused, granted_at(, admission_id, granted(, refused_id))], not {saved!r}")
    unused, granted_at, *last = saved
    if not last:
        return Lease(int(unused), float(granted_at))
    return Lease(int(unused), float(granted_at), str(last[0]), int(last[1]))


def _refused_ids(saved: Any) -> tuple[str, ...]:
    """A worker's refused group ids as :meth:`StalenessSnapshot.to_json` writes them."""
    if not isinstance(saved, list) or len(saved) > REFUSED_IDS_KEPT or not all(isinstance(i, str) for i in saved):
        raise TypeError(f"refused ids are a list of at most {REFUSED_IDS_KEPT} strings, not {saved!r}")
    return tuple(saved)
