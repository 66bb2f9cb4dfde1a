"""A router follows a restarted controller to its new address as soon as ``controller.json`` names
it, even while the old port still accepts connections: an old controller that still answers (it
was not killed, or its port went to another process), or a listener that never answers. Before,
a router looked at ``controller.json`` only after a poll failed: held for good by the first,
for each poll's timeout (30 s) by the second. Real controllers served in this process."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_elastic.client.control import ControlClient
from slurm_elastic.controller.files import publish
from slurm_elastic.router import Router
from tests.unit.served_controller import ServedController

TOKEN = "router-follow-token"
SERVER_JOB = {"autoscaler": {"min_workers": 0}, "workers": {"kind": "server", "command": ["engine", "{port}"]}}


def serve_with_server(state_dir: Path, worker_id: str) -> ServedController:
    """A server job's controller with one routable server ``worker_id``."""
    state_dir.mkdir()
    served = ServedController(state_dir, TOKEN, SERVER_JOB).launched(worker_id)
    with ControlClient(served.url, TOKEN) as client:
        client.register(worker_id, {"node": "node1", "gpus": [0], "step_id": "1", "ready": True,
                                    "endpoint": f"http://127.0.0.1:1/{worker_id}"})
        assert [e["worker_id"] for e in client.endpoints()["endpoints"]] == [worker_id]
    return served


@pytest.fixture
def job_dir(tmp_path: Path) -> Iterator[Path]:
    job = tmp_path / "job"
    job.mkdir()
    yield job


def wait_for_endpoints(router: Router, wanted: set[str], timeout_s: float) -> float:
    started = time.monotonic()
    while set(router.endpoints()) != wanted:
        assert time.monotonic() - started < timeout_s, f"router still has {set(router.endpoints())}, wanted {wanted}"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_router_leaves_an_old_controller_that_still_answers_for_the_one_controller_json_names(
        tmp_path: Path, job_dir: Path) -> None:
    old = serve_with_server(tmp_path / "old", "0001")
    publish(job_dir, old.url, 1)
    new = None
    try:
        with Router(old.url, TOKEN, state_dir=job_dir, poll_wait_s=3.0) as router:
            wait_for_endpoints(router, {"0001"}, 10.0)
            new = serve_with_server(tmp_path / "new", "0002")  # the restarted controller, elsewhere
            publish(job_dir, new.url, 1)
            assert wait_for_endpoints(router, {"0002"}, 5.0) < 5.0
            assert router._control.url == new.url
    finally:
        old.close()
        if new is not None:
            new.close()


def test_a_router_held_by_a_silent_listener_follows_the_new_controller_promptly(
        tmp_path: Path, job_dir: Path) -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections (the backlog), never answers
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    publish(job_dir, silent_url, 1)
    new = None
    try:
        with Router(silent_url, TOKEN, state_dir=job_dir, poll_wait_s=3.0) as router:
            time.sleep(0.3)  # its first poll is held
            new = serve_with_server(tmp_path / "new", "0002")
            publish(job_dir, new.url, 1)
            assert wait_for_endpoints(router, {"0002"}, 5.0) < 5.0
            started = time.monotonic()  # its load reports reach the new controller too (one held is dropped)
            while not new.controller.endpoints._reports:
                assert time.monotonic() - started < 5.0, "no load report reached the new controller"
                time.sleep(0.05)
    finally:
        silent.close()
        if new is not None:
            new.close()
