"""A worker mid-submit while its controller dies and comes back on another port: the submit finds
the new controller through ``controller.json`` and the group is stored once (the heartbeat thread,
which re-reads the URL too, does not close the line under the submit)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from slurm_elastic.controller.files import publish
from slurm_elastic.worker import RolloutWorker
from tests.unit.served_controller import ServedController

TOKEN = "follow-token"


def group(gid: str) -> dict[str, object]:
    return {"id": gid, "policy_version": 0, "group_size": 1, "sequences": [{"tokens": [1, 2, 3], "score": 0.5}]}


def serve(state_dir: Path) -> ServedController:
    server = ServedController(state_dir, TOKEN, {"autoscaler": {"min_workers": 0}}, batch_size=8)
    publish(state_dir, server.url, 1)
    return server


def test_a_submit_follows_the_controller_to_its_new_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    servers = [serve(tmp_path)]
    monkeypatch.setenv("SLURM_ELASTIC_WORKER_ID", "0001")
    monkeypatch.setenv("SLURM_ELASTIC_CONTROLLER_URL", servers[0].url)
    monkeypatch.setenv("SLURM_ELASTIC_TOKEN", TOKEN)
    monkeypatch.setenv("SLURM_ELASTIC_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("SLURM_ELASTIC_HEARTBEAT_INTERVAL_S", "0.2")
    with RolloutWorker.from_env() as worker:
        assert worker.submit(group("g0")) == {"accepted": True}
        servers[0].close()  # the controller dies; its successor listens elsewhere a second later
        threading.Timer(1.0, lambda: servers.append(serve(tmp_path))).start()
        started = time.monotonic()
        assert worker.submit(group("g1")) == {"accepted": True}
        assert time.monotonic() - started < 30
    assert servers[-1].url != servers[0].url and servers[-1].queue.stats()["queued_groups"] == 2
    servers[-1].close()
