"""Weights follow the trainer on the dev cluster: server workers run the fake SGLang engine
(tests/fake_engines.py); a publish reaches every server within the update timeout, and a server
added mid-run loads the latest weights before its first request."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from slurm_elastic.router import Router
from slurm_elastic.trainer import Trainer
from tests.cluster.controller_harness import ControllerJob, locate_in, wait_for
from tests.cluster.test_servers import Load

pytestmark = [pytest.mark.cluster, pytest.mark.second_cluster]
FAKE_ENGINES = str(Path(__file__).resolve().parents[1] / "fake_engines.py")
UPDATE_TIMEOUT_S = 10.0
ENGINES = {"workers": {"kind": "server", "command": [sys.executable, FAKE_ENGINES, "sglang", "{port}", "--model", "base"],
                       "readiness_path": "/health", "server_drain_grace_s": 0.5, "drain_timeout_s": 10.0},
           "weights": {"update": "sglang", "timeout_s": UPDATE_TIMEOUT_S, "retry_backoff_s": 0.2}}


def versions(job: ControllerJob) -> dict[str, int | None]:
    return {w["worker_id"]: w["weights_version"] for w in job.status()["workers"] if w["state"] == "ACTIVE"}


@pytest.mark.parametrize("job", [ENGINES], indirect=True)
def test_publishes_reach_every_server_and_a_new_server_loads_the_latest_before_its_first_request(
        job: ControllerJob) -> None:
    with job.client() as c:
        c.scale(2)
    job.active(2)
    url, token = locate_in(job.state_dir, job.job_id)
    trainer = Trainer(url, token, job.state_dir)
    try:
        published_at = time.monotonic()
        trainer.publish_version(1, weights="/ckpt/step-1")
        wait_for(lambda: versions(job) == {"0001": 1, "0002": 1}, UPDATE_TIMEOUT_S, "both servers at version 1")
        print(f"publish -> every server updated: {time.monotonic() - published_at:.2f} s")
        with Router(url, token, state_dir=job.state_dir, report_interval_s=0.2, poll_wait_s=1.0) as router, \
                Load(router, threads=3, gen_s=0.0):
            router.wait_for_endpoints(2, timeout_s=30)
            trainer.publish_version(2, weights="/ckpt/step-2")
            wait_for(lambda: versions(job) == {"0001": 2, "0002": 2}, UPDATE_TIMEOUT_S, "both servers at version 2")
            with job.client() as c:
                c.scale(3)  # mid-run: the new server starts on its base weights
            wait_for(lambda: "0003" in router.endpoints(), 40, "the new server routable")
            time.sleep(1.0)  # requests reach it
    finally:
        trainer.close()
    events = [e for e in job.events() if e["worker"] == "0003"]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and events[0]["weights_path"] == "base"
    first_request = kinds.index("request_begin")
    assert "loaded" in kinds[:first_request], kinds[:first_request + 1]
    assert {e["weights_path"] for e in events if e["event"] == "request_begin"} == {"/ckpt/step-2"}
    assert versions(job) == {"0001": 2, "0002": 2, "0003": 2}
    old = [e for e in job.events() if e["worker"] in ("0001", "0002") and e["event"] == "loaded"]
    assert sorted((e["worker"], e["version"]) for e in old) == [("0001", "1"), ("0001", "2"), ("0002", "1"),
                                                                 ("0002", "2")]


FAILING = {**ENGINES, "weights": {**ENGINES["weights"], "max_failures": 2},
           "worker_env": {"FAKE_UPDATE_FAILS_ON": "0002"}}


@pytest.mark.parametrize("job", [FAILING], indirect=True)
def test_a_server_that_fails_its_updates_leaves_discovery_and_is_replaced(job: ControllerJob) -> None:
    with job.client() as c:
        c.scale(2)
    job.active(2)
    url, token = locate_in(job.state_dir, job.job_id)
    trainer = Trainer(url, token, job.state_dir)
    try:
        with Router(url, token, state_dir=job.state_dir, poll_wait_s=1.0) as router:
            router.wait_for_endpoints(2, timeout_s=30)
            trainer.publish_version(1, weights="/ckpt/step-1")
            wait_for(lambda: set(router.endpoints()) == {"0001"}, UPDATE_TIMEOUT_S, "the failing server out of discovery")
            wait_for(lambda: set(router.endpoints()) == {"0001", "0003"}, 40, "its replacement routable")
    finally:
        trainer.close()
    status = job.active(2)
    assert {w["worker_id"]: w["weights_version"] for w in status["workers"]} == {"0001": 1, "0003": 1}
    failed = [e for e in job.events() if e["worker"] == "0002" and e["event"] == "update"]
    assert len(failed) >= 2  # max_failures (one more where both came before 0001 had loaded version 1)
    record = json.loads((job.state_dir / "state.json").read_text())["state"]["workers"]["0002"]
    assert any(h[3].startswith("weights update to version 1 failed 2 times in a row: HTTP 400")
               for h in record["history"]), record["history"]
