"""Client-side routing to the job's inference servers (vLLM, SGLang, any HTTP server worker).

    from slurm_elastic.router import Router

    with Router.from_env() as router:                  # or Router(url, token, state_dir=...)
        router.wait_for_endpoints(1)
        reply = router.request("POST", "/generate", json=payload, key=session_id)

The router keeps the set of routable servers fresh with a long-poll on the controller (no
hammering: one open request per router, answered when the set changes), sends each request to
the server with the fewest outstanding requests (or, with ``key``, to the same server while it
stays routable), never to a draining or dead one, retries idempotent requests on another server
when one dies or does not answer within ``request_timeout_s`` (a hung engine), ejects such a server
for ``eject_s`` (doubling while it keeps failing, up to ``max_eject_s``), and reports its outstanding requests per server to the controller, which uses
them to drain servers safely and to scale on load.

Every answer says which published weights the server that gave it runs
(``reply.extensions["weights_version"]``, None before any publish): submit the rollout with that
as its ``policy_version``, so staleness counts from what the server actually ran. With
``latest_weights_only=True`` the router sends only to servers at the latest published weights
(while a publish is being pushed, servers still on the previous version get nothing). A controller restart does not interrupt
routing: the last known set stays in use until the new controller answers. With the job's state
directory the router follows a restarted controller to its new address as soon as
``controller.json`` names it (:mod:`slurm_elastic.client.follow`, checked every ``FOLLOW_CHECK_S``
while a long-poll waits), even if the old port still accepts connections and never answers.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import queue
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from pydantic import BaseModel, StrictInt, StrictStr, ValidationError

from slurm_elastic.client.control import ControlClient
from slurm_elastic.client.follow import FollowedClient
from slurm_elastic.client.refusals import is_token_refusal
from slurm_elastic.errors import ControllerUnreachableError, SlurmElasticError

log = logging.getLogger(__name__)
EJECT_S = 5.0  # a server that failed a request gets none for this long; doubles per failure in a row
MAX_EJECT_S = 60.0
CLOSING_REPORT_TIMEOUT_S = 2.0  # close() waits at most this long for its last load report
REPORT_TIMEOUT_S = 3.0  # a load report not answered by then is dropped (the next goes to where the controller is)
WAIT_FOR_SERVER_S = 30.0  # a request sent while the router knows no server waits this long for one
FOLLOW_CHECK_S = 0.5  # while a long-poll waits, controller.json is looked at this often (a stat)


class _Endpoint(BaseModel):
    worker_id: StrictStr
    url: StrictStr
    weights_version: StrictInt | None = None


class EndpointsView(BaseModel):
    """The controller's ``/endpoints`` answer as the router reads it (validated once, here)."""

    version: StrictInt
    endpoints: list[_Endpoint]


def eject_penalty_s(failures_in_a_row: int, eject_s: float, max_eject_s: float) -> float:
    """How long a server that failed ``failures_in_a_row`` requests in a row gets no requests."""
    return float(min(max_eject_s, eject_s * 2 ** max(0, failures_in_a_row - 1)))


class RoutingError(SlurmElasticError):
    """No routable server, or a request failed on every server it may be retried on."""


class Router:
    """Routes requests over the controller's live endpoints."""

    def __init__(self, controller_url: str, token: str, *, state_dir: Path | None = None,
                 client_id: str | None = None, report_interval_s: float = 0.5, poll_wait_s: float = 20.0,
                 request_timeout_s: float = 300.0, eject_s: float = EJECT_S,
                 max_eject_s: float = MAX_EJECT_S, latest_weights_only: bool = False,
                 wait_for_server_s: float = WAIT_FOR_SERVER_S, token_source: str = "") -> None:
        self.token = token
        self.token_source = token_source or "the token this router was given"  # said when it is refused
        self.state_dir = state_dir
        self.client_id = client_id or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.report_interval_s = report_interval_s
        self.poll_wait_s = poll_wait_s
        self.eject_s, self.max_eject_s = eject_s, max_eject_s
        self.latest_weights_only = latest_weights_only
        self.wait_for_server_s = wait_for_server_s
        # follows a restarted controller; a replaced client is closed (the report thread handles that)
        self._line = FollowedClient(controller_url, token, state_dir, ControlClient, close_replaced=True)
        self._http = httpx.Client(timeout=request_timeout_s)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._endpoints: dict[str, str] = {}
        self._weights: dict[str, int | None] = {}  # the published weights version each server runs
        self._version = -1
        self._outstanding: Counter[str] = Counter()
        self._sent_to: Counter[str] = Counter()
        self._dead_until: dict[str, float] = {}
        self._failures_in_a_row: Counter[str] = Counter()
        self.sent = self.retried = self.failed = 0
        self.discovery_error = ""  # why the last poll of the endpoints failed ('' once one answered)
        self._refused_logged_s = -math.inf
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._discover_loop, name="router-discovery", daemon=True),
                         threading.Thread(target=self._report_loop, name="router-report", daemon=True)]
        for thread in self._threads:
            thread.start()

    @classmethod
    def from_env(cls, **kwargs: Any) -> Router:
        """Inside the job (the trainer step, a worker step, any step of the allocation): the
        controller is found from ``SLURM_JOB_ID`` alone, or from the variables
        :func:`~slurm_elastic.client.locate.controller_from_env` reads."""
        from slurm_elastic.client.locate import controller_from_env

        where = controller_from_env()
        return cls(where.url, where.token, state_dir=where.state_dir,
                   **{"token_source": where.token_source, **kwargs})

    @property
    def _control(self) -> ControlClient:
        """The client of the controller's current address."""
        return self._line.client

    # ---- discovery ---------------------------------------------------------------------------
    def _discover_loop(self) -> None:
        delay_s = 0.2
        while not self._stop.is_set():
            try:
                answer = self._poll()
                if answer is None:  # the controller moved (or the router closed): poll the new one at once
                    continue
                view = EndpointsView.model_validate(answer)
                delay_s, self.discovery_error = 0.2, ""
            except Exception as exc:  # unreachable, a malformed answer, a closed or unusable client: keep on
                if self._stop.is_set():
                    return
                self.discovery_error = str(exc)[:500]
                if is_token_refusal(exc) and time.monotonic() - self._refused_logged_s >= 60:  # once a minute
                    self._refused_logged_s = time.monotonic()
                    log.warning("discovery: the controller at %s refuses the router's token (%s; the token is from "
                                "%s): a wrong token, or another job's controller on the old address while this "
                                "job's restarts; asking again", self._line.client.url, exc, self.token_source)
                usual = isinstance(exc, (ControllerUnreachableError, SlurmElasticError))  # a restart, say
                log.log(logging.DEBUG if usual else logging.WARNING, "discovery: %s (keeping %d known endpoints)",
                        exc, len(self._endpoints), exc_info=not (usual or isinstance(exc, ValidationError)))
                self._line.refresh(force=True)
                self._stop.wait(delay_s)
                delay_s = min(5.0, delay_s * 2)
                continue
            with self._changed:
                if view.version != self._version:
                    self._version = view.version
                    self._endpoints = {e.worker_id: e.url.rstrip("/") for e in view.endpoints}
                    self._weights = {e.worker_id: e.weights_version for e in view.endpoints}
                    self._dead_until = {w: t for w, t in self._dead_until.items() if w in self._endpoints}
                    self._failures_in_a_row = Counter({w: n for w, n in self._failures_in_a_row.items()
                                                       if w in self._endpoints})
                    self._changed.notify_all()

    def _poll(self) -> dict[str, Any] | None:
        """One long-poll of the endpoints, sent from a thread of its own while this one looks for a
        moved controller every FOLLOW_CHECK_S: None if it moved (or the router closed) first. The
        poll to the old address is left to end on its own (a silent listener never answers it)."""
        control = self._line.client
        answers: queue.SimpleQueue[tuple[dict[str, Any] | None, BaseException | None]] = queue.SimpleQueue()

        def call() -> None:
            try:
                answers.put((control.endpoints(self._version, self.poll_wait_s, self.latest_weights_only), None))
            except BaseException as exc:  # raised in the discovery thread
                answers.put((None, exc))

        threading.Thread(target=call, name="router-poll", daemon=True).start()
        while True:
            try:
                view, error = answers.get(timeout=FOLLOW_CHECK_S)
            except queue.Empty:
                if self._stop.is_set() or self._line.refresh():
                    return None
                continue
            if error is not None:
                raise error
            return view

    def wait_for_endpoints(self, count: int = 1, timeout_s: float = 60.0) -> dict[str, str]:
        """Block until at least ``count`` servers are routable; returns worker id -> URL."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while len(self._endpoints) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RoutingError(f"{len(self._endpoints)} routable servers after {timeout_s:g} s, wanted {count}"
                                       f"{self._why_none()}")
                self._changed.wait(left)
            return dict(self._endpoints)

    def _wait_for_any(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not self._endpoints and not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)

    def _why_none(self) -> str:
        """What the last poll of the endpoints failed with, for an error that no server is known."""
        error = self.discovery_error
        return f"; the last poll of the endpoints failed: {error}" if error else ""

    def endpoints(self) -> dict[str, str]:
        with self._lock:
            return dict(self._endpoints)

    # ---- routing -----------------------------------------------------------------------------
    def pick(self, key: str | None = None, exclude: frozenset[str] = frozenset()) -> tuple[str, str]:
        """(worker id, URL): least outstanding, or sticky by ``key``; never a dead or excluded one."""
        with self._lock:
            now = time.monotonic()
            live = [w for w in self._endpoints if w not in exclude and self._dead_until.get(w, 0.0) <= now]
            if not live:
                raise RoutingError("no routable server" + (f" (tried {sorted(exclude)})" if exclude else ""))
            if key is not None:
                worker = max(live, key=lambda w: hashlib.blake2b(f"{key}|{w}".encode(), digest_size=8).digest())
            else:
                worker = min(live, key=lambda w: (self._outstanding[w], self._sent_to[w]))
            return worker, self._endpoints[worker]

    def request(self, method: str, path: str, *, key: str | None = None, idempotent: bool = True,
                max_attempts: int = 3, **kwargs: Any) -> httpx.Response:
        """Send to one server; on a dead or hung one (no answer within the request timeout) eject
        it for a while and retry an idempotent request on another. A request that gets no answer,
        none being routable included, counts as failed; a retry counts when it is sent. Sent while
        the router knows no server (none started yet; at the latest weights only, while a publish
        is pushed), it waits up to ``wait_for_server_s`` for one; ejected servers fail it at once."""
        self._wait_for_any(self.wait_for_server_s)
        tried: set[str] = set()
        last_error: Exception | None = None
        for attempt in range(max_attempts):
            try:
                worker, url = self.pick(key, frozenset(tried))
            except RoutingError as exc:
                with self._lock:
                    self.failed += 1
                    known = bool(self._endpoints)
                if not tried and not known:  # none came while it waited
                    only = (" at the latest published weights (latest_weights_only: servers on earlier weights "
                            "are not used)" if self.latest_weights_only else "")
                    raise RoutingError(f"no routable server{only} after waiting {self.wait_for_server_s:g} s "
                                       f"(wait_for_server_s){self._why_none()}") from None
                if not tried:
                    raise
                raise RoutingError(f"{method} {path} failed on {sorted(tried)}: {last_error}; {exc}") from None
            with self._lock:
                self.retried += 1 if attempt else 0
                self._outstanding[worker] += 1
                self._sent_to[worker] += 1
                self.sent += 1
                weights_version = self._weights.get(worker)  # as sent: the older one if it updates meanwhile
            try:
                reply = self._http.request(method, url + path, **kwargs)
                with self._lock:
                    self._failures_in_a_row.pop(worker, None)
                reply.extensions = {**reply.extensions, "worker_id": worker, "weights_version": weights_version}
                return reply
            except httpx.TransportError as exc:  # timeouts included
                last_error = exc
                self._eject(worker)
                tried.add(worker)
                if not idempotent:
                    break
                log.info("server %s failed (%s); retrying elsewhere", worker, type(exc).__name__)
            finally:
                with self._lock:
                    self._outstanding[worker] -= 1
        with self._lock:
            self.failed += 1
        raise RoutingError(f"{method} {path} failed on {sorted(tried)}: {last_error}")

    def _eject(self, worker: str) -> None:
        """No requests to ``worker`` for eject_s, doubled for each failure in a row, at most max_eject_s."""
        with self._lock:
            self._failures_in_a_row[worker] += 1
            penalty_s = eject_penalty_s(self._failures_in_a_row[worker], self.eject_s, self.max_eject_s)
            self._dead_until[worker] = time.monotonic() + penalty_s

    # ---- load reports ------------------------------------------------------------------------
    def _report_loop(self) -> None:
        while not self._stop.wait(self.report_interval_s):
            self.report_now()

    def report_now(self) -> None:
        with self._lock:
            outstanding = {w: n for w, n in self._outstanding.items() if n > 0 or w in self._endpoints}
            totals = (self.sent, self.retried, self.failed)
        try:
            self._control.report_load(self.client_id, outstanding, *totals, timeout_s=REPORT_TIMEOUT_S)
        except RuntimeError:  # httpx's "client has been closed": the router closed, or followed a moved
            pass  # controller (discovery swapped the client) under this report: the next one goes there
        except (SlurmElasticError, KeyError) as exc:
            log.debug("load report failed: %s", exc)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            return {"sent": self.sent, "retried": self.retried, "failed": self.failed,
                    "ejected": sorted(w for w, t in self._dead_until.items() if t > now),
                    "outstanding": dict(self._outstanding), "endpoints": len(self._endpoints)}

    def close(self) -> None:
        """Stop its threads; a last report says it has nothing in flight (else the controller counts
        its last outstanding requests as load until the report ages out, 10 s)."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()  # a request waiting for a server gives up now
        with self._lock:
            totals = (self.sent, self.retried, self.failed)
        try:
            self._control.report_load(self.client_id, {}, *totals, timeout_s=CLOSING_REPORT_TIMEOUT_S)
        except (SlurmElasticError, KeyError, RuntimeError) as exc:
            log.debug("closing load report failed: %s", exc)
        self._line.close()
        for thread in self._threads:
            thread.join(timeout=5)
        self._http.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
