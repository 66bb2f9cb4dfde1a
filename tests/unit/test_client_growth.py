"""Authenticated clients cannot grow the controller's state: registrations from worker ids the
controller did not launch are refused (404) and record nothing, and load reports from ever new
router ids are pruned by age and capped. Through the real HTTP server."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from slurm_elastic.controller.app import create_controller_app
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.serve import ApiServer
from slurm_elastic.core.endpoints import MAX_LOAD_CLIENTS
from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.slurm.parse import StepInfo
from tests.stub_backend import ListedSteps

TOKEN = "t0ken"


@dataclass
class Live:
    controller: Controller
    backend: ListedSteps
    http: httpx.Client


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    """A controller (one launched worker, 0001, registered on node1 GPU 0) behind the real server."""
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    backend = ListedSteps()
    controller = Controller(config, 1, backend, tmp_path, gpus_by_node={"node1": (0, 1)})  # type: ignore[arg-type]
    controller.scale(1)
    controller.tick()
    backend.steps.append(StepInfo(1, "0", worker_step_name("0001"), ("node1",), "0:01", "", "gres/gpu:1", 1))
    controller.tick()
    server = ApiServer(create_controller_app(controller, TOKEN), "127.0.0.1")
    server.start()
    try:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http:
            assert http.post("/workers/0001/register", json={"node": "node1", "gpus": [0], "step_id": "0"}).is_success
            yield Live(controller, backend, http)
    finally:
        server.stop()


def test_registrations_from_ids_it_did_not_launch_are_refused_and_record_nothing(live: Live) -> None:
    ctl = live.controller
    ctl.save()
    state_before = ctl.state_file.path.read_bytes()
    workers_before = {k: w.to_json() for k, w in ctl.workers.items()}
    for i in range(1000):
        answer = live.http.post(f"/workers/f{i:04d}/register", json={"node": "node1", "gpus": [1], "step_id": "9"})
        assert answer.status_code == 404, answer.text
    assert "not launched by this controller" in answer.json()["detail"]
    assert ctl.state_file.path.read_bytes() == state_before
    assert {k: w.to_json() for k, w in ctl.workers.items()} == workers_before
    for _ in range(5):
        ctl.tick()
    assert set(ctl.workers) == {"0001"} and ctl.workers["0001"].state.value == "ACTIVE"
    assert ctl.status()["cordoned_gpus"] == []


def test_a_running_step_without_a_record_may_register(live: Live) -> None:
    """After a restart without saved state the listing is what the controller launched."""
    live.backend.steps.append(StepInfo(1, "1", worker_step_name("0007"), ("node1",), "0:01", "", "gres/gpu:1", 1))
    assert live.http.post("/workers/0007/register", json={"node": "node1", "gpus": [1]}).status_code == 404
    live.controller.scale(2)
    live.controller.tick()  # the listing now shows se-w-0007 (and adopts it)
    answer = live.http.post("/workers/0007/register", json={"node": "node1", "gpus": [1], "step_id": "1"})
    assert answer.status_code == 200 and answer.json()["action"] == "run"


def test_load_reports_from_ever_new_clients_stay_bounded(live: Live) -> None:
    ctl = live.controller
    for i in range(300):  # through the server: the route and the controller keep what they should
        assert live.http.post("/endpoints/load", json={"client_id": f"r{i}", "outstanding": {"0001": 1}}).is_success
    assert len(ctl.endpoints._reports) == MAX_LOAD_CLIENTS
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(10_000):  # in process, to keep the test fast: the same call the route makes
            ctl.report_load(f"client-{i}", {"0001": 1, **{f"x{j}": 1 for j in range(50)}})
        grown_b = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert len(ctl.endpoints._reports) == MAX_LOAD_CLIENTS
    assert all(set(r.outstanding) == {"0001"} for r in ctl.endpoints._reports.values())  # unknown ids not kept
    assert grown_b < 1_000_000, grown_b


def test_a_cordon_reason_with_escape_codes_is_refused(live: Live) -> None:
    for reason in ("\x1b[2J\x1b[31mowned", "two\nlines", "x" * 300):
        answer = live.http.post("/admin/cordon", json={"node": "node1", "gpu": 1, "reason": reason})
        assert answer.status_code == 422 and "reason" in answer.text
    assert live.controller.status()["cordoned_gpus"] == []
    answer = live.http.post("/admin/cordon", json={"node": "node1", "gpu": 1, "reason": "fan noise, é 日本"})
    assert answer.status_code == 200


def test_a_registered_worker_registering_again_elsewhere_does_not_move(live: Live) -> None:
    """A step does not move: a second registration of a running worker naming other GPUs (another
    process using its id, a confused client) leaves the record where the step runs, so no two
    workers are booked on one GPU."""
    assert live.controller.workers["0001"].state.value == "ACTIVE"
    moved = live.http.post("/workers/0001/register", json={"node": "node2", "gpus": [0, 1, 2, 3], "step_id": "0"})
    assert moved.status_code == 200, moved.text
    assert (live.controller.workers["0001"].node, live.controller.workers["0001"].gpus) == ("node1", (0,))
    again = live.http.post("/workers/0001/register", json={"node": "node1", "gpus": [0], "step_id": "0"})
    assert again.status_code == 200 and live.controller.workers["0001"].gpus == (0,)
    live.controller.workers["0001"].endpoint = "http://node1:8000"
    assert live.http.post("/workers/0001/register", json={"node": "node1", "gpus": [0], "step_id": "999"}).is_success
    assert (live.controller.workers["0001"].step_id, live.controller.workers["0001"].endpoint) == ("0", "http://node1:8000")
    rank = live.http.post("/workers/0001/register", json={"node": "node2", "gpus": [0, 1, 2, 3], "rank": 1})
    assert rank.status_code == 404 and "spans one node" in rank.text  # its crashes would be blamed on node2's GPUs
    assert live.controller.workers["0001"].node_gpus == {}
