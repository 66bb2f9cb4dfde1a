"""Which weights each server runs, and which servers are due an update (pure; time passed in).

The trainer publishes a version with where its weights are (:class:`PublishedWeights`). Every
server that runs another version is due an update through the configured hook, retried after a
backoff (doubling per failure in a row) up to ``max_failures`` in a row. Once some server has
loaded the version (the weights are good), a server that fails it leaves discovery at once and
after ``max_failures`` is to be replaced. Until then a failure may be the weights' (a path
mistyped): the servers keep serving the weights they run, stay in discovery, and none is
replaced; a server that gave up on them and runs other weights than the fleet (one started or
relaunched since) is given the newest weights some server loaded (the fallback), enters discovery
on them, and is replaced if it cannot load those either. A server enters discovery only once it
runs the latest published weights; one that joined at an earlier version stays routable while its
update to the latest is under way (routers that want only the latest filter on the version). A failed update of a version already
superseded counts for nothing.

What a restarted controller needs of each server's updates is saved with its state
(:class:`SavedUpdates`): its failures in a row (a server that keeps failing is replaced whatever
the restarts in between), and the update in flight with when it was sent. A server whose update
was in flight when the controller stopped may be loading it still: it is sent nothing until
``update_timeout_s`` after it was sent, then an order that asks the server which version it runs
first (``confirm``), so a server that loaded it is not sent it again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from slurm_elastic.core.defaults import (
    WEIGHTS_MAX_FAILURES,
    WEIGHTS_RETRY_BACKOFF_S,
    WEIGHTS_TIMEOUT_S,
)


@dataclass(frozen=True)
class PublishedWeights:
    version: int
    ref: str  # a path on the shared filesystem, or an engine-specific reference


@dataclass(frozen=True)
class ServerWeights:
    """What the book needs of one ACTIVE server: where it listens and the version it runs."""

    worker_id: str
    url: str
    loaded_version: int | None  # None: what it started with (not published weights)


@dataclass(frozen=True)
class UpdateOrder:
    """Push ``weights`` to one server (``attempt`` counts from 1 per failures in a row)."""

    worker_id: str
    url: str
    weights: PublishedWeights
    attempt: int
    confirm: bool = False  # an earlier controller sent it: ask the server's version before sending again


@dataclass(frozen=True)
class UpdateOutcome:
    """What the controller does after an update: record the version, wait for a retry, or replace."""

    action: Literal["loaded", "retry", "replace"]
    reason: str = ""


@dataclass(frozen=True)
class SavedUpdates:
    """One server's updates as the controller's state keeps them across a restart."""

    failures: int = 0  # failed updates in a row
    in_flight: int | None = None  # the version being pushed
    on_fallback: bool = False  # ... and it is the fallback, not the latest
    sent_at_s: float = 0.0  # when the update in flight was sent
    retry_at_s: float = 0.0
    last_error: str = ""


@dataclass
class _Updates:
    failures: int = 0  # failed updates in a row
    in_flight: int | None = None  # the version being pushed now
    on_fallback: bool = False  # ... and it is the fallback (the fleet's weights), not the latest
    sent_at_s: float = 0.0  # when the update in flight was sent
    adopted: bool = False  # ... by an earlier controller: no answer of it comes to this one
    confirm: bool = False  # the next order asks the server's version first (an adopted update ended unheard)
    retry_at_s: float = 0.0
    last_error: str = ""


@dataclass
class WeightsBook:
    """The latest published weights and each server's updates. ``enforced`` False (no update
    hook configured): versions are recorded and shown, but every server is routable."""

    enforced: bool = True
    max_failures: int = WEIGHTS_MAX_FAILURES
    retry_backoff_s: float = WEIGHTS_RETRY_BACKOFF_S
    update_timeout_s: float = WEIGHTS_TIMEOUT_S  # one update's limit: an adopted one has ended by then
    latest: PublishedWeights | None = None
    fallback: PublishedWeights | None = None  # the newest weights some server loaded, while the latest are not
    _updates: dict[str, _Updates] = field(default_factory=dict)
    _joined: set[str] = field(default_factory=set)  # were in discovery: at the latest, or before any publish
    _seeded: bool = False
    _proven: bool = False  # some server has loaded the latest version

    def publish(self, version: int, ref: str) -> bool:
        """The trainer's new weights; True if they differ from the latest."""
        new = PublishedWeights(version, ref)
        if new == self.latest:
            return False
        self.fallback = self.fallback_after(version, ref)
        self.latest, self._proven = new, False
        for updates in self._updates.values():  # new weights: a server waiting out a backoff may try them now
            updates.failures, updates.retry_at_s = 0, 0.0
        return True

    def fallback_after(self, version: int, ref: str) -> PublishedWeights | None:
        """What the fallback would be after a publish of ``version`` at ``ref`` (saved before it)."""
        if PublishedWeights(version, ref) == self.latest:
            return self.fallback
        kept = self.latest if self._proven else self.fallback
        return kept if kept is not None and kept.version <= version else None  # not a version gone back from

    def conflict(self, version: int, ref: str) -> str | None:
        """Why a plain publish of ``version`` at ``ref`` is refused (None: it is not): that version
        was published with other weights, and a server counts as up to date by its version alone."""
        latest = self.latest
        if latest is None or latest.version != version or latest.ref == ref:
            return None
        return (f"version {version} was published with the weights at {latest.ref!r}: other weights need a new "
                f"version (the servers at version {version} would keep the old ones)")

    def routable(self, worker_id: str, loaded_version: int | None) -> bool:
        """Whether an ACTIVE server with ``loaded_version`` may be in discovery."""
        if not self.enforced or self.latest is None:
            return True
        if self._proven and self._updates.get(worker_id, _Updates()).failures > 0:
            return False  # failed weights another server loaded: out until an update succeeds
        if loaded_version == self.latest.version or worker_id in self._joined:
            return True
        return not self._seeded and loaded_version is not None  # restored, before the first round adopts it

    def due(self, servers: Iterable[ServerWeights], now_s: float) -> list[UpdateOrder]:
        """Updates to send now (marked in flight): every server not at the latest version, with no
        update in flight, past its backoff and under ``max_failures`` (past it, the fallback where
        :meth:`_fallback_for` gives one). An update an earlier controller sent counts as in flight
        until ``update_timeout_s`` after it was sent; the order after it asks the server's version
        first. Servers not listed are forgotten."""
        servers = list(servers)
        listed = {s.worker_id for s in servers}
        self._updates = {w: u for w, u in self._updates.items() if w in listed}
        self._joined &= listed
        if not self._seeded:  # after a restart: servers already at a published version stay in discovery
            self._seeded = True
            self._joined |= {s.worker_id for s in servers if s.loaded_version is not None}
        latest = self.latest
        if latest is None or not self.enforced:
            self._joined |= listed  # all in discovery: they stay while the first publish reaches them
            return []
        orders = []
        for server in servers:
            if server.loaded_version == latest.version:
                self._joined.add(server.worker_id)
                self._prove()
                continue
            updates = self._updates.setdefault(server.worker_id, _Updates())
            if updates.adopted and now_s >= updates.sent_at_s + self.update_timeout_s:
                updates.in_flight, updates.adopted, updates.confirm = None, False, True  # ended unheard
            if updates.in_flight is not None or updates.retry_at_s > now_s:
                continue
            weights = latest if updates.failures < self.max_failures else self._fallback_for(server)
            if weights is None:
                continue
            orders.append(UpdateOrder(server.worker_id, server.url, weights, min(updates.failures + 1, self.max_failures),
                                      updates.confirm))
            updates.in_flight, updates.on_fallback, updates.sent_at_s = weights.version, weights is not latest, now_s
            updates.confirm = False
        return orders

    def done(self, worker_id: str, version: int, error: str, now_s: float) -> UpdateOutcome:
        """An update of ``worker_id`` to ``version`` ended (``error`` empty: it succeeded)."""
        updates = self._updates.setdefault(worker_id, _Updates())
        fallback = updates.on_fallback and not self._proven
        updates.in_flight, updates.on_fallback, updates.adopted = None, False, False
        latest = self.latest
        if not error:
            if fallback:  # on the fleet's weights now: in discovery, the latest not tried again
                self._joined.add(worker_id)
                return UpdateOutcome("loaded")
            updates.failures, updates.retry_at_s, updates.last_error = 0, 0.0, ""
            if latest is not None and version == latest.version:
                self._joined.add(worker_id)
                self._prove()
            return UpdateOutcome("loaded")
        if fallback:
            updates.last_error = error
            return UpdateOutcome("replace", f"weights version {version}, which the other servers run, failed too "
                                            f"(no server has loaded version {latest.version if latest else '?'}): "
                                            f"{error}")
        if latest is not None and version != latest.version:  # superseded: the latest is due next, at once
            return UpdateOutcome("retry", f"weights update to version {version} failed ({error}); version "
                                          f"{latest.version} is due next")
        updates.failures += 1
        updates.last_error = error
        updates.retry_at_s = now_s + self.retry_backoff_s * 2 ** (updates.failures - 1)
        if updates.failures >= self.max_failures and not self._proven:
            return UpdateOutcome("retry", f"weights update to version {version} failed {updates.failures} times "
                                          f"in a row and no server has loaded it: kept in discovery on the weights "
                                          f"it runs, not replaced (publish again to retry): {error}")
        if updates.failures >= self.max_failures:
            return UpdateOutcome("replace", f"weights update to version {version} failed {updates.failures} "
                                            f"times in a row: {error}")
        return UpdateOutcome("retry", f"weights update to version {version} failed "
                                      f"({updates.failures}/{self.max_failures}): {error}")

    def _fallback_for(self, server: ServerWeights) -> PublishedWeights | None:
        """The weights a server that gave up on the latest is given: the fallback, while no server
        has loaded the latest and this one runs other weights and is not in discovery."""
        fallback = self.fallback
        if self._proven or fallback is None or server.loaded_version == fallback.version \
                or server.worker_id in self._joined:
            return None
        return fallback

    def _prove(self) -> None:
        """A server loaded the latest version: the weights are good. A server that gave up on them
        while none had gets one more try, and is replaced if that fails too."""
        if self._proven:
            return
        self._proven, self.fallback = True, None
        for updates in self._updates.values():
            if updates.failures >= self.max_failures:
                updates.failures, updates.retry_at_s = self.max_failures - 1, 0.0

    def joined(self) -> list[str]:
        """The servers in discovery by these rules (saved with the controller's state)."""
        return sorted(self._joined)

    def rejoin(self, worker_ids: Iterable[str]) -> None:
        """Servers a previous controller had in discovery: they stay in while an update reaches them
        (a server on the weights it started with, say, that the first publish had not yet reached)."""
        self._joined |= set(worker_ids)

    def saved_updates(self) -> dict[str, SavedUpdates]:
        """Each server's updates worth keeping across a restart (saved with the controller's state)."""
        return {w: SavedUpdates(u.failures, u.in_flight, u.on_fallback, u.sent_at_s, u.retry_at_s, u.last_error)
                for w, u in sorted(self._updates.items()) if u.failures or u.in_flight is not None}

    def restore_updates(self, saved: Mapping[str, SavedUpdates], now_s: float) -> None:
        """A previous controller's :meth:`saved_updates`: failures in a row count on, and an update
        it had in flight is adopted (no answer of it comes here; see :meth:`due`). A time ahead of
        ``now_s`` (a clock set back, a damaged file) is taken as now, and a backoff as no longer than
        the longest one there is, so no server waits for good."""
        longest_backoff_s = self.retry_backoff_s * 2 ** max(0, self.max_failures - 1)
        for worker_id, s in saved.items():
            self._updates[worker_id] = _Updates(s.failures, s.in_flight, s.on_fallback, min(s.sent_at_s, now_s),
                                                adopted=s.in_flight is not None,
                                                retry_at_s=min(s.retry_at_s, now_s + longest_backoff_s),
                                                last_error=s.last_error)

    def server_view(self, worker_id: str) -> dict[str, object]:
        """A server's update state for status: failures in a row, the version in flight, the last error."""
        updates = self._updates.get(worker_id, _Updates())
        return {"weights_update_failures": updates.failures, "weights_updating_to": updates.in_flight,
                "weights_update_error": updates.last_error}

    def view(self) -> dict[str, object] | None:
        """The latest published weights (None before the first publish)."""
        if self.latest is None:
            return None
        return {"version": self.latest.version, "ref": self.latest.ref, "enforced": self.enforced}
