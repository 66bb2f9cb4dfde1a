"""A pool beats no faster than ``workers.max_heartbeats_per_s`` allows: on the dev cluster, real
worker steps (their wrappers and their commands' SDK) beat at the interval the controller tells
them, and the pool stays live at it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.cluster.controller_harness import ControllerJob, wait_for

pytestmark = pytest.mark.cluster
SDK_WORKER = str(Path(__file__).with_name("sdk_worker.py"))


@pytest.mark.parametrize("job", [{
    "workers": {"command": [sys.executable, SDK_WORKER], "max_heartbeats_per_s": 2.0, "heartbeat_grace_s": 30.0},
    "worker_env": {"ROLLOUT_S": "1.0"}}], indirect=True)
def test_workers_beat_at_the_interval_they_are_told(job: ControllerJob) -> None:
    """4 workers configured to beat every 0.3 s, each with a wrapper and an SDK: 8 senders held to
    2 beats a second together are told 4 s (unpaced they would send 27 a second)."""
    with job.client() as c:
        c.scale(4)
        job.active(4)

        def paced() -> bool:
            st = job.status()
            return st["heartbeat_senders"] == 8 and st["heartbeat_interval_s"] == 4.0

        wait_for(paced, 30, "8 senders told 4 s")
        time.sleep(4.5)  # every sender has had an answer with the new interval
        before, t0 = job.status()["heartbeats"], time.monotonic()
        time.sleep(12.0)
        rate = (job.status()["heartbeats"] - before) / (time.monotonic() - t0)
        assert 0.5 <= rate <= 3.0, rate  # 2 a second, give or take a beat per sender
        status = job.status()
        assert sorted(w["state"] for w in status["workers"]) == ["ACTIVE"] * 4  # none lost at the slower beat
        wait_for(lambda: any(w["busy"] for w in job.status()["workers"]), 10, "busy flags from SDK beats")
        c.scale(0)
    job.active(0)


@pytest.mark.parametrize("job", [{
    "workers": {"command": ["srun", "--overlap", "--nodes=1", "--ntasks=1", sys.executable, SDK_WORKER]},
    "worker_env": {"ROLLOUT_S": "1.0"}}], indirect=True)
def test_an_sdk_under_an_srun_of_its_command_counts_for_its_worker(job: ControllerJob) -> None:
    """The command starts its SDK in a step of its own (an srun inside the worker's step): the
    SDK's beats name the worker's step (the wrapper's SLURM_ELASTIC_STEP), not the inner one, so
    the controller applies its counts: the busy worker (0002, always mid-rollout) reads busy."""
    with job.client() as c:
        c.scale(2)
        job.active(2)
        wait_for(lambda: {w["worker_id"]: w["busy"] for w in job.status()["workers"]} == {"0001": False, "0002": True},
                 20, "busy flags from the SDK's beats")
        # each worker's wrapper and its SDK (counted at the tick after each SDK's first beat; 0001's may come later)
        wait_for(lambda: job.status()["heartbeat_senders"] == 4, 20, "4 senders")
        c.scale(0)
    job.active(0)
