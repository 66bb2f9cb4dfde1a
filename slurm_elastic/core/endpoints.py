"""Routable server endpoints and the load routers report: pure bookkeeping (time passed in).

The controller publishes the set of ACTIVE server workers with an endpoint; every change bumps
a version, so clients can long-poll ("tell me when it is no longer version N") or use ETags.
Routers report their outstanding requests per worker; the book sums the fresh reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_LOAD_CLIENTS = 256  # routers whose reports are kept at once (the oldest report goes first)
TOTALS_CLIENTS_KEPT = 4096  # routers whose last totals are kept apart (the requests they add count once)


@dataclass(frozen=True)
class Endpoint:
    worker_id: str
    url: str
    node: str
    gpus: tuple[int, ...]
    weights_version: int | None = None  # the published weights it runs (None: what it started with)


@dataclass
class _ClientReport:
    at_s: float
    outstanding: dict[str, int]
    sent: int = 0
    retried: int = 0
    failed: int = 0


@dataclass
class EndpointBook:
    """The routable set (versioned) and the load on it."""

    report_ttl_s: float = 10.0
    max_clients: int = MAX_LOAD_CLIENTS
    version: int = 0
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    weights_version: int | None = None  # the latest published weights (None: none published)
    _reports: dict[str, _ClientReport] = field(default_factory=dict)
    _last_totals: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # per router, its last report's
    _totals: tuple[int, int, int] = (0, 0, 0)  # requests sent, retried, failed by every router that reported

    def publish(self, endpoints: list[Endpoint], weights_version: int | None = None) -> bool:
        """Replace the routable set (and the latest weights version); True (and a new version) if it changed."""
        new = {e.worker_id: e for e in endpoints}
        if new == self.endpoints and weights_version == self.weights_version:
            return False
        self.endpoints, self.weights_version = new, weights_version
        self.version += 1
        return True

    def report(self, client_id: str, outstanding: dict[str, int], now_s: float, sent: int = 0,
               retried: int = 0, failed: int = 0) -> None:
        """A router's current outstanding requests per worker (and its running totals).

        Reports older than ``report_ttl_s`` are dropped, and at most ``max_clients`` are kept; the
        totals of a router dropped still count in the job's (:meth:`totals`)."""
        self._count(client_id, (sent, retried, failed))
        self._reports.pop(client_id, None)  # re-inserted last: the dict stays in report order
        self._reports[client_id] = _ClientReport(now_s, {k: max(0, int(v)) for k, v in outstanding.items()},
                                                 sent, retried, failed)
        self._reports = prune_reports(self._reports, now_s, self.report_ttl_s, self.max_clients)

    def _count(self, client_id: str, totals: tuple[int, int, int]) -> None:
        """Add what a router's running totals grew by since its last report (all of them, for a
        router not heard before or whose totals went down: a new process under that id). The last
        totals of at most TOTALS_CLIENTS_KEPT routers are kept (the longest silent forgotten)."""
        last = self._last_totals.pop(client_id, None)
        self._last_totals[client_id] = totals
        if len(self._last_totals) > TOTALS_CLIENTS_KEPT:
            del self._last_totals[next(iter(self._last_totals))]
        grew = totals if last is None or any(n < b for n, b in zip(totals, last, strict=True)) else tuple(
            n - b for n, b in zip(totals, last, strict=True))
        self._totals = (self._totals[0] + grew[0], self._totals[1] + grew[1], self._totals[2] + grew[2])

    def _fresh(self, now_s: float) -> list[_ClientReport]:
        self._reports = prune_reports(self._reports, now_s, self.report_ttl_s, self.max_clients)
        return list(self._reports.values())

    def totals(self) -> tuple[int, int, int]:
        """Requests sent, retried and failed by every router that reported to this controller."""
        return self._totals

    def outstanding(self, worker_id: str, now_s: float) -> int:
        return sum(r.outstanding.get(worker_id, 0) for r in self._fresh(now_s))

    def total_outstanding(self, now_s: float) -> int:
        return sum(sum(r.outstanding.values()) for r in self._fresh(now_s))

    def load_ratio(self, capacity_per_server: float, now_s: float) -> float | None:
        """outstanding / (routable servers x capacity); None without servers."""
        if not self.endpoints or capacity_per_server <= 0:
            return None
        return self.total_outstanding(now_s) / (len(self.endpoints) * capacity_per_server)

    def view(self, now_s: float, latest_weights_only: bool = False) -> dict[str, Any]:
        """The set for discovery; ``latest_weights_only``: only servers at the latest published weights."""
        fresh = self._fresh(now_s)
        return {
            "version": self.version,
            "weights_version": self.weights_version,
            "endpoints": [{"worker_id": e.worker_id, "url": e.url, "node": e.node, "gpus": list(e.gpus),
                           "weights_version": e.weights_version, "outstanding": self.outstanding(e.worker_id, now_s)}
                          for e in sorted(self.endpoints.values(), key=lambda e: e.worker_id)
                          if not latest_weights_only or e.weights_version == self.weights_version],
            "routers": len(fresh),
            **dict(zip(("requests_sent", "requests_retried", "requests_failed"), self.totals(), strict=True)),
        }


def prune_reports(reports: dict[str, _ClientReport], now_s: float, ttl_s: float,
                  max_clients: int) -> dict[str, _ClientReport]:
    """The reports at most ``ttl_s`` old, the newest ``max_clients`` of them (``reports`` is in
    report order, oldest first); ``reports`` itself when nothing goes."""
    if len(reports) <= max_clients and all(now_s - r.at_s <= ttl_s for r in reports.values()):
        return reports
    fresh = [(c, r) for c, r in reports.items() if now_s - r.at_s <= ttl_s]
    return dict(fresh[-max_clients:] if max_clients > 0 else [])
