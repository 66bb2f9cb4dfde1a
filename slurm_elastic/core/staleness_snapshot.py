"""The staleness counts as the queue saves them, so that they survive a restart exactly (pure).

:class:`StalenessSnapshot` holds AReaL's counts (:mod:`slurm_elastic.core.staleness`) with the
workers' leases, their refused group ids and the workers whose steps stand stopped; it is
checked when read back, and refused where it would open as a capacity above the bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from slurm_elastic.core.staleness import (
    MAX_VERSION,
    REFUSED_IDS_KEPT,
    REFUSED_IDS_SAVED,
    AdmissionLeases,
    Lease,
)


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
    stopped: frozenset[str] = frozenset()

    @classmethod
    def take(cls, leases: AdmissionLeases, dropped_seqs: int, at_seq: int) -> StalenessSnapshot:
        staleness = leases.staleness
        return cls(staleness.version, staleness.accepted + dropped_seqs, at_seq, dict(leases.leases),
                   dict(leases.refused), leases.stopped)

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
        leases.restore(self.leases, arrived_seqs, self.refused, self.stopped)

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
        refused: dict[str, Any] = {"refused": {w: list(ids[-REFUSED_IDS_SAVED:]) for w, ids in self.refused.items()}} \
            if self.refused else {}
        refused |= {"stopped": sorted(self.stopped)} if self.stopped else {}
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
            stopped = data.get("stopped", [])
            if not isinstance(stopped, list) or not all(isinstance(w, str) for w in stopped):
                raise TypeError(f"stopped workers are a list of ids, not {stopped!r}")
            snapshot = cls(int(data["version"]), int(data["gross_seqs"]), int(data["at_seq"]), leases, refused,
                           frozenset(stopped))
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
