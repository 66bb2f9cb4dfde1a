"""Liveness after ready: the pure decision, the wrapper's probe on a hung server, the controller
taking a not-live server out of discovery at once (through the real HTTP server), and the
router ejecting a server that times out."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest

from slurm_elastic.controller.app import create_controller_app
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.metrics import metrics_registry
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.serve import ApiServer
from slurm_elastic.core.lifecycle import Worker, WorkerState
from slurm_elastic.core.liveness import drain_not_live, not_live_reason
from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.core.reconcile import Drain, Launch, ObservedStep, ReconcileConfig, reconcile
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.router import Router, RoutingError, eject_penalty_s
from slurm_elastic.slurm.backend import StepSpec
from slurm_elastic.slurm.parse import StepInfo
from slurm_elastic.worker.liveness import LivenessProbe, probe_server
from tests.stub_backend import ListedSteps

S = WorkerState
TOKEN = "t0ken"


def server(worker_id: str = "0001", failures: int = 0, state: WorkerState = S.ACTIVE, placeholder: bool = False) -> Worker:
    return Worker(worker_id, state=state, step_id=str(int(worker_id)), node="node1", gpus=(0,),
                  endpoint="http://n:1", liveness_failures=failures, placeholder=placeholder)


# ---- the pure decision ------------------------------------------------------------------------
@pytest.mark.parametrize(("worker", "threshold", "not_live"), [
    (server(failures=2), 3, False),  # below the threshold
    (server(failures=3), 3, True),
    (server(failures=9), 0, False),  # threshold 0: liveness off
    (server(failures=3, state=S.STARTING), 3, False),  # not ready yet: readiness rules
    (server(failures=3, state=S.DRAINING), 3, False),  # already leaving
    (server(failures=3, placeholder=True), 3, False),  # placeholders serve nothing
])
def test_not_live_only_for_an_active_server_at_the_threshold(worker: Worker, threshold: int, not_live: bool) -> None:
    assert bool(not_live_reason(worker, threshold)) is not_live


def test_a_not_live_server_drains_once_with_the_reason_in_its_history() -> None:
    worker = server(failures=3)
    assert drain_not_live([worker], 3, now_s=50.0) == [worker]
    assert worker.state is S.DRAINING and worker.drain_started_s == 50.0
    assert not worker.failure_reason  # a drain, not a kill: it leaves capacity and is replaced
    assert "3 failed liveness probes" in worker.history[-1][3]
    assert drain_not_live([worker], 3, now_s=51.0) == []


def test_reconcile_drains_a_not_live_server_and_launches_its_replacement() -> None:
    workers = {"0001": server("0001", failures=3), "0002": server("0002")}
    observed = [ObservedStep(w.worker_id, w.step_id, w.node) for w in workers.values()]
    cfg = ReconcileConfig(liveness_failure_threshold=3)
    plan = reconcile(workers, observed, 2, 8, (), frozenset(), cfg, 10.0, 3)
    assert Drain("0001", "1") in plan.actions
    assert [a.worker_id for a in plan.actions if isinstance(a, Launch)] == ["0003"]
    assert workers["0001"].state is S.DRAINING and workers["0002"].state is S.ACTIVE


def test_a_relaunch_starts_with_no_failed_probes() -> None:
    worker = server(failures=3, state=S.BACKOFF)
    worker.step_id = ""
    reconcile({"0001": worker}, [], 1, 8, (), frozenset(), ReconcileConfig(liveness_failure_threshold=3), 0.0, 2)
    assert worker.state is S.STARTING and worker.liveness_failures == 0


# ---- real servers on this host: one answers, one hangs ----------------------------------------
@dataclass
class FakeEngine:
    """An HTTP server that answers 200 (health and generate) until ``hang`` is set; then it
    accepts connections and never answers, as a hung engine does."""

    hang: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    served: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                pass

            def _answer(self) -> None:
                if engine.hang.is_set():
                    engine.release.wait()
                    return
                engine.served.append(self.path)
                self.send_response(200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def do_GET(self) -> None:
                self._answer()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", "0")))
                self._answer()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def engines() -> Iterator[tuple[FakeEngine, FakeEngine]]:
    good, hung = FakeEngine(), FakeEngine()
    yield good, hung
    good.close()
    hung.close()


def test_the_probe_fails_on_a_hung_engine_and_counts_in_a_row(engines: tuple[FakeEngine, FakeEngine]) -> None:
    _good, engine = engines
    assert probe_server(engine.port, "/health", timeout_s=2.0)
    engine.hang.set()
    assert not probe_server(engine.port, "/health", timeout_s=0.2)  # connects, no answer
    assert probe_server(engine.port, "", timeout_s=0.2)  # why a hung engine needs an HTTP path
    probe = LivenessProbe(engine.port, "/health", interval_s=0.01, timeout_s=0.05, name="0001").start()
    try:
        _wait(lambda: probe.failures >= 3)
        engine.hang.clear()
        _wait(lambda: probe.failures == 0)  # an answer resets the count
    finally:
        probe.stop()


def test_the_probe_fails_on_a_listener_that_never_accepts() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # the kernel completes connects; nobody ever reads
        assert not probe_server(listener.getsockname()[1], "/health", timeout_s=0.2)


class RecordingSteps(ListedSteps):
    def __init__(self) -> None:
        super().__init__()
        self.launched: list[str] = []
        self.signalled: list[str] = []

    def launch_step(self, spec: StepSpec, launcher_log: Path) -> int:
        self.launched.append(spec.name)
        return 0

    def signal_step(self, job_id: int, step_id: str, signal_name: str) -> None:
        self.signalled.append(step_id)


@dataclass
class Live:
    controller: Controller
    backend: RecordingSteps
    http: httpx.Client
    url: str


@pytest.fixture
def live(tmp_path: Path, engines: tuple[FakeEngine, FakeEngine]) -> Iterator[Live]:
    """A server controller behind the real HTTP server, with two ready servers: 0001 (good), 0002 (hung)."""
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0},
                           "workers": {"kind": "server", "liveness_failure_threshold": 3,
                                       "server_drain_grace_s": 0}})
    backend = RecordingSteps()
    controller = Controller(config, 1, backend, tmp_path, gpus_by_node={"node1": (0, 1, 2, 3)})  # type: ignore[arg-type]
    controller.scale(2)
    controller.tick()
    for number in (1, 2):
        backend.steps.append(StepInfo(1, str(number), worker_step_name(f"000{number}"), ("node1",), "0:01", "",
                                      "gres/gpu:1", 1))
    controller.tick()
    api = ApiServer(create_controller_app(controller, TOKEN), "127.0.0.1")
    api.start()
    try:
        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http:
            for number, engine in zip((1, 2), engines, strict=True):
                assert http.post(f"/workers/000{number}/register", json={
                    "node": "node1", "gpus": [number], "step_id": str(number), "endpoint": engine.url}).is_success
            yield Live(controller, backend, http, api.url)
    finally:
        api.stop()


def test_a_not_live_heartbeat_takes_the_server_out_of_discovery_at_once(live: Live) -> None:
    with Router(live.url, TOKEN, poll_wait_s=0.5) as router:
        assert set(router.wait_for_endpoints(2, timeout_s=10)) == {"0001", "0002"}
        assert live.http.post("/workers/0002/heartbeat", json={"liveness_failures": 2}).json()["drain"] is False
        assert {e["worker_id"] for e in live.http.get("/endpoints").json()["endpoints"]} == {"0001", "0002"}
        live.http.post("/workers/0002/heartbeat", json={"liveness_failures": 3})
        # no tick ran: the heartbeat alone took it out, and the router's long-poll sees it gone
        assert {e["worker_id"] for e in live.http.get("/endpoints").json()["endpoints"]} == {"0001"}
        _wait(lambda: set(router.endpoints()) == {"0001"})
    worker = live.controller.workers["0002"]
    assert worker.state is S.DRAINING and "not live" in worker.history[-1][3]
    launched_before = len(live.backend.launched)
    live.controller.tick()  # the next tick: the drain signal (nothing in flight) and a replacement
    assert live.backend.signalled == ["2"]
    assert live.backend.launched[launched_before:] == [worker_step_name("0003")]


def test_a_bad_liveness_count_is_refused(live: Live) -> None:
    for bad in (-1, "x", 2**64):
        assert live.http.post("/workers/0001/heartbeat", json={"liveness_failures": bad}).status_code == 422
    assert live.controller.workers["0001"].state is S.ACTIVE


# ---- the router ejects a server that does not answer ------------------------------------------
def test_the_eject_penalty_doubles_per_failure_in_a_row_up_to_the_cap() -> None:
    assert [eject_penalty_s(n, 5.0, 60.0) for n in (1, 2, 3, 4, 5)] == [5.0, 10.0, 20.0, 40.0, 60.0]


def test_a_timed_out_server_is_ejected_and_the_request_retried_elsewhere(
        live: Live, engines: tuple[FakeEngine, FakeEngine]) -> None:
    good, hung = engines
    hung.hang.set()
    # 2 s: the good server answers within it on a loaded 2-core CI host (at 0.3 s it once timed out too)
    with Router(live.url, TOKEN, poll_wait_s=0.5, request_timeout_s=2.0, eject_s=600.0) as router:
        router.wait_for_endpoints(2, timeout_s=10)
        replies = [router.request("POST", "/generate", json={"i": i}, key="session-a") for i in range(6)]
        replies += [router.request("POST", "/generate", json={"i": i}) for i in range(6)]
        stats = router.stats()
    assert [r.status_code for r in replies] == [200] * 12  # none lost
    assert stats["ejected"] == ["0002"] and stats["failed"] == 0
    assert stats["retried"] == 1  # only the first request met the hung server: then it was ejected
    assert len(good.served) == 12


def test_a_request_no_server_answers_counts_as_failed_and_only_sent_retries_count(
        live: Live, engines: tuple[FakeEngine, FakeEngine]) -> None:
    """Before, a request whose retries ran out of servers ("no routable server") was not counted
    as failed, and its last retry, never sent, was counted as retried."""
    for engine in engines:
        engine.hang.set()
    with Router(live.url, TOKEN, poll_wait_s=0.5, request_timeout_s=0.3, eject_s=600.0) as router:
        router.wait_for_endpoints(2, timeout_s=10)
        with pytest.raises(RoutingError, match="failed on \\['0001', '0002'\\]"):
            router.request("POST", "/generate", json={})  # both hung: tried both, then none left
        with pytest.raises(RoutingError, match="no routable server"):
            router.request("POST", "/generate", json={})  # both ejected: sent nowhere
        stats = router.stats()
    assert (stats["sent"], stats["retried"], stats["failed"]) == (2, 1, 2)


def _wait(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_router_that_closes_leaves_no_requests_counted_in_flight(live: Live, tmp_path: Path) -> None:
    """Before, its last report's outstanding requests counted as load until the report aged out (10 s)."""
    router = Router(live.url, TOKEN, poll_wait_s=0.5, report_interval_s=60.0)
    router.wait_for_endpoints(2, timeout_s=10)
    with router._lock:
        router._outstanding["0001"] = 3  # requests in flight at its last report
    router.report_now()
    assert live.controller.status()["servers"]["endpoints"][0]["outstanding"] == 3
    queue = RolloutQueue(RolloutStore(tmp_path / "q.sqlite", fsync="off"), QueueConfig())
    metrics = generate_latest(metrics_registry(live.controller, queue)).decode()  # the same, for Prometheus
    queue.store.close()
    assert all(line in metrics.splitlines() for line in (
        "slurm_elastic_servers_routable 2.0", "slurm_elastic_server_requests_outstanding 3.0",
        "slurm_elastic_server_load_ratio 0.1875", "slurm_elastic_routers 1.0")), metrics
    router.close()
    servers = live.controller.status()["servers"]
    assert [e["outstanding"] for e in servers["endpoints"]] == [0, 0] and servers["load_ratio"] == 0.0


def test_a_server_that_says_it_is_leaving_is_out_of_discovery_at_once_and_no_drain_is_sent(live: Live) -> None:
    """Its wrapper got the drain signal itself (an operator's scancel, a preemption): the heartbeat
    that says so takes it out of ``/endpoints`` before its command hears the signal, and it is
    DRAINING from then, saying why (before, ACTIVE until its step ended "exited cleanly"); the
    controller signals nothing more (its wrapper forwards the signal after the routers' grace)."""
    with Router(live.url, TOKEN, poll_wait_s=0.5) as router:
        assert set(router.wait_for_endpoints(2, timeout_s=10)) == {"0001", "0002"}
        assert live.http.post("/workers/0002/heartbeat", json={"leaving": True}).json()["drain"] is False
        assert {e["worker_id"] for e in live.http.get("/endpoints").json()["endpoints"]} == {"0001"}
        _wait(lambda: set(router.endpoints()) == {"0001"})
    live.controller.tick()
    leaving = live.controller.workers["0002"]
    assert live.backend.signalled == [] and leaving.state is S.DRAINING
    assert leaving.history[-1][3] == "the drain signal reached its step (scancel --signal, or Slurm's)"
    assert live.http.post("/workers/0002/heartbeat", json={}).json()["drain"] is False  # its wrapper's grace holds
    assert {e["worker_id"] for e in live.http.get("/endpoints").json()["endpoints"]} == {"0001"}
    assert live.http.post("/workers/0001/heartbeat", json={"leaving": "yes"}).status_code == 422
    assert live.http.post("/workers/0001/heartbeat", json={"leaving": True, "leaving_signal": "kill -9"}
                          ).status_code == 422
