"""Fuzz the controller's whole API from its own OpenAPI schema (schemathesis): never a 5xx.

The app runs in-process over a real rollout store on disk and a real controller object; its
Slurm backend is the real CLI (requests that would act on Slurm name no known worker or step).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from slurm_elastic.controller.app import create_controller_app
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.slurm.cli_backend import SlurmCli

TOKEN = "fuzz-token"


def make_app(tmp: Path):  # type: ignore[no-untyped-def]
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    queue = RolloutQueue(RolloutStore(tmp / "q.sqlite"), QueueConfig(batch_size=8, capacity_seqs=64,
                                                                      max_group_bytes=100_000))
    controller = Controller(config, 1, SlurmCli(timeout_s=5), tmp, gpus_by_node={"node1": (0, 1, 2, 3)}, queue=queue)
    return create_controller_app(controller, TOKEN, queue)


APP_DIR = Path(__import__("tempfile").mkdtemp(prefix="se-fuzz-"))
schema = schemathesis.openapi.from_asgi("/openapi.json", make_app(APP_DIR), headers={"Authorization": f"Bearer {TOKEN}"})


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_never_answers_5xx(case: schemathesis.Case) -> None:
    if case.path == "/endpoints" and case.query:
        case.query["wait_s"] = 0  # no long-polls while fuzzing
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {TOKEN}"}
    response = case.call()
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:500])


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic abc", "Bearer"])
def test_every_route_needs_the_token(header: str | None, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    client = TestClient(make_app(tmp_path))  # a store of its own: the fuzzed app holds APP_DIR's
    headers = {"Authorization": header} if header else {}
    for route in client.app.routes:  # type: ignore[attr-defined]
        path = getattr(route, "path", "")
        path = re.sub(r"\{[^}]*\}", "0123456789abcdef0123456789abcdef", path)  # any path parameter
        for method in getattr(route, "methods", set()) - {"HEAD"}:
            status = client.request(method, path, headers=headers).status_code
            assert status in (401, 403), (method, path, status)
    assert client.get("/healthz", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    for page in ("/docs", "/redoc"):  # no unauthenticated pages at all
        assert client.get(page).status_code in (401, 403, 404)
