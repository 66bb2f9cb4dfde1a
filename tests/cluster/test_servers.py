"""Server workers end to end on the dev cluster: discovery, routing, drain and failures."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.router import Router
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import ControllerJob, locate_in, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.second_cluster]
FAKE_SERVER = str(Path(__file__).with_name("fake_server.py"))
SERVERS = {"workers": {"kind": "server", "command": [sys.executable, FAKE_SERVER, "{port}"],
                       "readiness_path": "/health", "server_drain_grace_s": 0.5, "drain_timeout_s": 20.0},
           "worker_env": {"GEN_S": "0.3"}}


@pytest.fixture
def router(job: ControllerJob, monkeypatch: pytest.MonkeyPatch) -> Iterator[Router]:
    """A router made as a step of the job makes it: from SLURM_JOB_ID alone, the job's state
    directory found through Slurm (the job's comment), not from the default place."""
    monkeypatch.setenv("SLURM_ELASTIC_HOME", str(job.tmp / "elsewhere"))
    for name in ("SLURM_ELASTIC_STATE_DIR", "SLURM_ELASTIC_CONTROLLER_URL", "SLURM_ELASTIC_TOKEN",
                 "SLURM_ELASTIC_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", str(job.job_id))
    with Router.from_env(report_interval_s=0.2, poll_wait_s=1.0) as r:
        assert r.state_dir == job.state_dir  # so a restarted controller is followed (test below)
        yield r


class Load:
    """``threads`` loops sending requests until stopped; records (worker, sent_at, ok)."""

    def __init__(self, router: Router, threads: int, gen_s: float) -> None:
        self.router, self.gen_s = router, gen_s
        self.results: list[tuple[str, float, bool]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(threads)]

    def _loop(self, index: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            sent_at = time.time()
            try:
                reply = self.router.request("POST", "/generate", json={"id": f"{index}-{n}", "gen_s": self.gen_s})
                ok, worker = reply.status_code == 200, reply.json()["worker"]
            except Exception:
                ok, worker = False, "?"
            with self.lock:
                self.results.append((worker, sent_at, ok))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


@pytest.mark.parametrize("job", [SERVERS], indirect=True)
def test_requests_spread_by_least_outstanding(job: ControllerJob, router: Router) -> None:
    with job.client() as c:
        c.scale(3)
    job.active(3)
    router.wait_for_endpoints(3, timeout_s=30)
    replies: Counter[str] = Counter()
    lock = threading.Lock()

    def send(i: int) -> None:
        reply = router.request("POST", "/generate", json={"id": i})
        with lock:
            replies[reply.json()["worker"]] += 1

    threads = [threading.Thread(target=lambda k=k: [send(k * 100 + j) for j in range(6)]) for k in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(replies.values()) == 54 and len(replies) == 3
    assert max(replies.values()) - min(replies.values()) <= 6, replies
    status = job.status()
    assert {e["worker_id"] for e in status["servers"]["endpoints"]} == set(replies)
    assert status["servers"]["routers"] == 1 and status["servers"]["load_ratio"] is not None


@pytest.mark.parametrize("job", [SERVERS], indirect=True)
def test_drained_server_gets_no_new_requests_and_finishes_its_own(job: ControllerJob, router: Router) -> None:
    with job.client() as c:
        c.scale(2)
        job.active(2)
        router.wait_for_endpoints(2, timeout_s=30)
        with Load(router, threads=4, gen_s=0.5) as load:
            time.sleep(1.5)
            drain_at = time.time()
            c.drain("0001")
            time.sleep(3.0)
        c.scale(1)  # keep it from being replaced for the check below
    events = job.events()
    late = [e for e in events if e["worker"] == "0001" and e["event"] == "request_begin" and e["t"] > drain_at + 0.3]
    assert late == []  # nothing new after the drain started (router view lag < 0.3 s)
    begun = {e["id"] for e in events if e["worker"] == "0001" and e["event"] == "request_begin"}
    ended = {e["id"] for e in events if e["worker"] == "0001" and e["event"] == "request_end"}
    assert begun and begun == ended  # its in-flight requests finished
    drained = [e for e in events if e["worker"] == "0001" and e["event"] == "drained"]
    last_end = max(e["t"] for e in events if e["worker"] == "0001" and e["event"] == "request_end")
    assert drained and drained[0]["t"] >= last_end  # signalled only once nothing was in flight there
    assert all(ok for _w, _t, ok in load.results) and len(load.results) > 10


@pytest.mark.parametrize("job", [SERVERS], indirect=True)
def test_a_server_step_signalled_by_the_operator_leaves_routing_before_its_engine_drains(
        job: ControllerJob, router: Router) -> None:
    """`scancel --signal=USR1 JOB.STEP` reaches the step, not the controller: the wrapper takes the
    server out of discovery first, so no request is routed to an engine that is draining."""
    with job.client() as c:
        c.scale(2)
        status = job.active(2)
        router.wait_for_endpoints(2, timeout_s=30)
        step = next(w["step_id"] for w in status["workers"] if w["worker_id"] == "0001")
        with Load(router, threads=4, gen_s=0.3) as load:
            time.sleep(1.5)
            run_command(["scancel", "--signal=USR1", f"{job.job_id}.{step}"], check=False)  # 22.05: 225 after a --signal
            time.sleep(3.0)
        c.scale(1)
    events = job.events()
    heard = [e for e in events if e["worker"] == "0001" and e["event"] == "request_begin" and e["draining"]]
    assert heard == []  # nothing was routed to it once its engine had the drain signal
    assert [e for e in events if e["worker"] == "0001" and e["event"] == "drained"]
    assert all(ok for _w, _t, ok in load.results) and len(load.results) > 10
    ended = wait_for(lambda: next((w for w in job.status()["ended_workers"] if w["worker_id"] == "0001"), None), 30,
                     "0001 to end")  # DRAINING from its wrapper's word, not ACTIVE until "exited cleanly"
    assert "the drain signal reached its step" in ended["reason"], ended


@pytest.mark.parametrize("job", [SERVERS], indirect=True)
def test_killed_server_requests_are_retried_elsewhere(job: ControllerJob, router: Router) -> None:
    with job.client() as c:
        c.scale(3)
    job.active(3)
    router.wait_for_endpoints(3, timeout_s=30)
    victim = next(e for e in job.events() if e["event"] == "start" and e["worker"] == "0002")
    with Load(router, threads=6, gen_s=1.0) as load:
        time.sleep(1.5)
        os.kill(victim["pid"], signal.SIGKILL)  # the server dies with requests in flight
        time.sleep(3.0)
    assert load.results and all(ok for _w, _t, ok in load.results)  # none lost
    assert router.stats()["retried"] >= 1 and router.stats()["failed"] == 0
    wait_for(lambda: job.status()["servers"]["requests_retried"] >= 1, 10, "retries reported to the controller")


@pytest.mark.parametrize("job", [SERVERS], indirect=True)
def test_discovery_survives_a_controller_restart(job: ControllerJob, router: Router) -> None:
    with job.client() as c:
        c.scale(2)
    job.active(2)
    before = router.wait_for_endpoints(2, timeout_s=30)
    pid = job.controller_pid()
    os.kill(pid, signal.SIGKILL)
    replies = [router.request("POST", "/generate", json={"id": i}).status_code for i in range(5)]
    assert replies == [200] * 5  # routing goes on while no controller runs
    wait_for(lambda: job.controller_pid() != pid, 30, "a new controller")
    status: dict[str, Any] = job.active(2, timeout_s=30)
    assert all(w["launches"] == 1 for w in status["workers"] if w["state"] == "ACTIVE")  # re-adopted
    assert wait_for(lambda: router.endpoints() == before, 20, "the same endpoints")
    with job.client() as c:
        c.scale(3)
    router.wait_for_endpoints(3, timeout_s=30)  # the new controller's discovery works


LOAD_SCALING = {**SERVERS, "autoscaler": {
    "min_workers": 1, "max_workers": 4, "requests_per_worker_capacity": 2, "scale_up_threshold": 0.8,
    "scale_down_threshold": 0.3, "confirmations": 2, "scale_up_cooldown": 1.0, "scale_down_cooldown": 1.0,
    "min_stable_period": 0.5, "stabilization_window_s": 2.0, "max_step_up": 4, "max_step_down": 4}}


@pytest.mark.parametrize("job", [LOAD_SCALING], indirect=True)
def test_load_rises_servers_added_load_falls_servers_drained(job: ControllerJob, router: Router) -> None:
    job.active(1, timeout_s=30)  # the autoscaler's minimum
    router.wait_for_endpoints(1, timeout_s=30)
    with Load(router, threads=8, gen_s=1.0) as load:  # 8 in flight vs 2 per server: 4 servers needed
        status = job.active(4, timeout_s=40)
        assert status["last_decision"]["action"] in ("scale_up", "hold")
        time.sleep(1.0)
    status = job.active(1, timeout_s=40)  # idle again: back to the minimum
    assert "load ratio" in status["last_decision"]["reason"]
    assert all(ok for _w, _t, ok in load.results)  # nothing lost through the scale-up and the scale-down
    drained = {e["worker"] for e in job.events() if e["event"] == "drained"}
    assert len(drained) == 3


LIVENESS = {**SERVERS, "workers": {**SERVERS["workers"], "liveness_failure_threshold": 2, "liveness_interval_s": 0.5,
                                   "liveness_timeout_s": 0.5, "drain_timeout_s": 3.0}}


@pytest.mark.parametrize("job", [LIVENESS], indirect=True)
def test_hung_server_leaves_discovery_is_replaced_and_no_request_is_lost(job: ControllerJob) -> None:
    with job.client() as c:
        c.scale(2)
    job.active(2)
    url, token = locate_in(job.state_dir, job.job_id)
    with Router(url, token, state_dir=job.state_dir, report_interval_s=0.2, poll_wait_s=1.0,
                request_timeout_s=2.0) as router:
        router.wait_for_endpoints(2, timeout_s=30)
        victim = next(e for e in job.events() if e["event"] == "start" and e["worker"] == "0002")
        with Load(router, threads=4, gen_s=0.3) as load:
            time.sleep(1.0)
            os.kill(victim["pid"], signal.SIGUSR2)  # accepts connections, never answers again
            hung_at = time.monotonic()
            wait_for(lambda: "0002" not in router.endpoints(), 20, "the hung server out of discovery")
            out_s = time.monotonic() - hung_at
            wait_for(lambda: "0003" in router.endpoints(), 30, "its replacement routable")
            print(f"hung -> out of discovery {out_s:.2f} s, -> replacement routable {time.monotonic() - hung_at:.2f} s")
            time.sleep(1.0)  # requests go on over the old good server and the replacement
        stats = router.stats()
    assert load.results and all(ok for _w, _t, ok in load.results)  # none lost
    assert stats["failed"] == 0 and stats["retried"] >= 1  # what was in flight on the hung one went elsewhere
    assert {w for w, _t, _ok in load.results} >= {"0001", "0003"}
    status = job.active(2, timeout_s=30)  # drained (cancelled after the drain timeout: it ignores the signal)
    assert sorted(w["worker_id"] for w in status["workers"]) == ["0001", "0003"]
    record = json.loads((job.state_dir / "state.json").read_text())["state"]["workers"]["0002"]
    reasons = [h[3] for h in record["history"]]
    assert any("not live: 2 failed liveness probes in a row (threshold 2)" in r for r in reasons), reasons
    assert record["state"] == "INACTIVE"
    assert [e["event"] for e in job.events() if e["worker"] == "0002" and e["event"] in ("hung", "drained")] == ["hung"]


NEVER_READY = {"workers": {"kind": "server", "command": [sys.executable, FAKE_SERVER, "{port}"],
                           "readiness_path": "/never", "start_timeout_s": 3.0, "backoff_base_s": 0.5,
                           "backoff_max_s": 1.0}}


@pytest.mark.parametrize("job", [NEVER_READY], indirect=True)
def test_a_server_never_ready_is_stopped_and_relaunched_without_a_crash_cordon(job: ControllerJob) -> None:
    """Its wrapper stops it at start_timeout_s, three times over: the worker backs off, the GPU
    is not crash-cordoned (it was, after three, on every GPU of the job)."""
    with job.client() as c:
        c.scale(1)

    def stops() -> list[str]:
        workers = job.status()["workers"]
        return [h[3] for w in workers for h in w["history"] if "server not ready after 3 s" in h[3]]

    wait_for(lambda: len(stops()) >= 3, 90, "three stops for not being ready")
    status = job.status()
    assert status["cordoned_gpus"] == [], status["cordoned_gpus"]
