"""The queued groups in memory: small records in arrival order, by id and by policy version,
with their totals. No storage and no lock: the rollout queue holds its lock around every call."""

from __future__ import annotations

import collections
from collections.abc import Iterator

from slurm_elastic.core.staleness import is_untrainable
from slurm_elastic.rollouts.packing import oldest_exact_batch
from slurm_elastic.rollouts.storage import StoredGroup


class QueuedGroups:
    """Groups waiting for a batch. Groups dropped as stale leave the counts at once and the
    arrival-order deque when a batch's window or the head passes them (O(1) each, once)."""

    def __init__(self) -> None:
        self._order: collections.deque[StoredGroup] = collections.deque()
        self._ids: set[str] = set()
        self._by_version: dict[int, dict[str, StoredGroup]] = {}
        self._dropped_ids: set[str] = set()  # dropped, still in _order until passed
        self._arrivals = 0  # groups ever appended: what the whole-queue search was last run at
        self._searched_whole_at: int | None = None  # _arrivals when a search of the whole queue found nothing
        self.seqs = 0
        self.nbytes = 0

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def append(self, group: StoredGroup, at: int | None = None) -> None:
        """Queue ``group``: last, or at position ``at``."""
        if at is None:
            self._order.append(group)
        else:
            self._order.insert(at, group)
        self._ids.add(group.id)
        self._arrivals += 1
        self._by_version.setdefault(group.version, {})[group.id] = group
        self.seqs += group.n_seqs
        self.nbytes += group.nbytes

    def size_counts(self) -> collections.Counter[int]:
        """How many queued groups hold each number of sequences."""
        return collections.Counter(g.n_seqs for groups in self._by_version.values() for g in groups.values())

    def put_back(self, groups: list[StoredGroup]) -> None:
        """Groups taken for a batch that was not recorded: queued again where they were (arrival
        order; they were near the head)."""
        for group in sorted(groups, key=lambda g: g.seq, reverse=True):
            at = 0
            while at < len(self._order) and self._order[at].seq < group.seq:
                at += 1
            self.append(group, at)

    def untrainable(self, version: int, max_staleness: int) -> list[StoredGroup]:
        """Every queued group a trainer at ``version`` cannot train on (stale, or made past it),
        wherever it sits (by version: O(groups found + versions queued))."""
        return [g for v in [v for v in self._by_version if is_untrainable(v, version, max_staleness)]
                for g in self._by_version[v].values()]

    def drop(self, groups: list[StoredGroup]) -> None:
        """Take queued groups out (dropped: stale, or made past the trainer's version)."""
        for group in groups:
            self._forget(group)
            self._dropped_ids.add(group.id)
        while self._order and self._order[0].id in self._dropped_ids:
            self._dropped_ids.discard(self._order.popleft().id)

    def take_batch(self, batch_size: int, lookahead_groups: int) -> list[StoredGroup] | None:
        """Take out whole groups summing to exactly ``batch_size``: the oldest that make one
        among the first ``batch_size + lookahead_groups`` (a batch has at most ``batch_size``
        groups, so up to ``lookahead_groups`` are passed over; :func:`.oldest_exact_batch`); when
        that window holds none, the oldest among all queued groups (so groups that fit with nothing
        cannot fill the window and block the queue; searched again only once more have arrived);
        None if no batch can be made."""
        if self.seqs < batch_size:
            return None
        batch = self._take(batch_size, batch_size + lookahead_groups)
        if batch is None and len(self._order) > batch_size + lookahead_groups \
                and self._searched_whole_at != self._arrivals:
            batch = self._take(batch_size, len(self._order))
            self._searched_whole_at = None if batch else self._arrivals
        return batch

    def _take(self, batch_size: int, limit: int) -> list[StoredGroup] | None:
        """The oldest exact batch among the first ``limit`` groups, taken out. The window is read
        from the head only as far as the packing needs; the groups not taken go back in order:
        O(window)."""
        window: list[StoredGroup] = []

        def sizes() -> Iterator[int]:
            while self._order and len(window) < limit:
                group = self._order.popleft()
                if group.id in self._dropped_ids:
                    self._dropped_ids.discard(group.id)
                    continue
                window.append(group)
                yield group.n_seqs

        taken: list[int] | None = None
        try:
            taken = oldest_exact_batch(sizes(), batch_size)
        finally:  # (whatever happened, the groups not taken are back in order)
            chosen = set(taken or ())
            self._order.extendleft(reversed([g for i, g in enumerate(window) if i not in chosen]))
        if taken is None:
            return None
        batch = [window[i] for i in taken]
        for group in batch:
            self._forget(group)
        return batch

    def _forget(self, group: StoredGroup) -> None:
        """Out of the counts and the indexes (handed out or dropped)."""
        self._ids.discard(group.id)
        self.seqs -= group.n_seqs
        self.nbytes -= group.nbytes
        same_version = self._by_version[group.version]
        del same_version[group.id]
        if not same_version:
            del self._by_version[group.version]
