"""Which quarantined (lost) groups the trainer has been told of, so each is named at least once.

Lost ids are named with the next batch handed out, and again with that batch until it is
acknowledged. How many lost groups, oldest first, an acknowledged batch named is saved in the
store (:meth:`RolloutStorage.save_lost_told`); after a restart every other lost group is named
again. Not thread-safe: the queue calls it with its lock held.
"""

from __future__ import annotations


class LostReports:
    """The lost group ids still to tell, told with each unacknowledged batch, and acknowledged."""

    def __init__(self, lost_ids: list[str], told_count: int) -> None:
        """``lost_ids``: every lost group, oldest first (the store's order); ``told_count``: how
        many of them an acknowledged batch named (saved)."""
        self._order = list(lost_ids)
        self._acked_count = min(told_count, len(self._order))
        self._acked = set(self._order[:self._acked_count])
        self._unreported = self._order[self._acked_count:]  # told again: no acknowledged batch named them
        self._told: dict[str, list[str]] = {}  # batch id -> lost ids told with it (until its ack)

    def quarantined(self, ids: list[str]) -> None:
        """Groups found damaged now: to be told with the next batch."""
        self._unreported += ids
        self._order += ids

    def ids_for(self, batch_id: str, unacknowledged: bool) -> list[str]:
        """The ids to tell with batch ``batch_id``: those told with it before and those lost
        since; remembered with it while it is ``unacknowledged``."""
        ids = self._told.get(batch_id, []) + self._unreported
        self._unreported = []
        if unacknowledged:
            self._told[batch_id] = ids
        return ids

    def acknowledged(self, batch_id: str) -> int | None:
        """The trainer acknowledged ``batch_id``: the new count of lost groups told for good, to
        save, or None if it did not change."""
        self._acked.update(self._told.pop(batch_id, []))
        count = self._acked_count
        while count < len(self._order) and self._order[count] in self._acked:
            count += 1
        if count == self._acked_count:
            return None
        self._acked_count = count
        return count
