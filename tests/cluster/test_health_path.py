"""GPU health end to end on the dev cluster: agent steps -> controller -> placement, driven by the
fault-injection file (the same drill an operator runs). A worker on a GPU turning unhealthy is
drained and replaced elsewhere: tests/unit/test_controller_replay.py; a fault injected through the
agents, cordoned, stepped around and lifted: the chaos soak (tests/cluster/test_chaos.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.controller_harness import ControllerJob, wait_for

pytestmark = pytest.mark.cluster

HEALTH = {"healthy_period_s": 3.0, "agent_silence_s": 6.0}


def drill(tmp: Path) -> Path:
    return tmp / "drill.toml"


def gpus_with_workers(status: dict[str, Any]) -> set[tuple[str, int]]:
    return {(w["node"], g) for w in status["workers"] if w["state"] == "ACTIVE" and not w["placeholder"]
            for g in w["gpus"]}


@pytest.mark.parametrize("job", [{"agent": {"enabled": True, "source": "inject", "interval_s": 0.5},
                                  "health": HEALTH, "workers": {"initial_workers": 3}}], indirect=True)
def test_the_initial_workers_start_once_the_agents_have_reported(job: ControllerJob) -> None:
    """No GPU is usable before its node's agent reports; the initial count waits for it (it was
    dropped to zero at the first tick, first seen on a real GPU node)."""
    job.active(3, timeout_s=60)
    assert job.status()["unknown_health_nodes"] == []


@pytest.mark.parametrize("job", [{"agent": {"enabled": True, "source": "inject", "interval_s": 0.5},
                                  "health": HEALTH}], indirect=True)
def test_silent_agent_means_health_unknown_no_new_workers_there(job: ControllerJob) -> None:
    from slurm_elastic.slurm.cli_backend import SlurmCli

    with job.client() as c:
        c.scale(4)
        job.active(4, timeout_s=60)
        c.pause()
    slurm = SlurmCli()
    agent = next(s for s in slurm.list_steps(job.job_id) if s.name == "se-agent-node2")
    slurm.signal_step(job.job_id, agent.step_id, "STOP")  # the agent hangs: it stops reporting
    wait_for(lambda: job.status()["unknown_health_nodes"] == ["node2"], 20, "node2 health unknown")
    before = {w["worker_id"] for w in job.status()["workers"] if w["state"] == "ACTIVE"}
    with job.client() as c:
        c.scale(8)
    time.sleep(3.0)
    status = job.status()
    new = [w for w in status["workers"] if w["worker_id"] not in before and w["state"] in ("STARTING", "ACTIVE")]
    assert all(w["node"] == "node1" for w in new if w["node"])  # nothing new on node2
    assert {w["worker_id"] for w in status["workers"] if w["state"] == "ACTIVE"} >= before  # old ones keep running
    slurm.signal_step(job.job_id, agent.step_id, "CONT")
    wait_for(lambda: job.status()["unknown_health_nodes"] == [], 20, "node2 heard again")


@pytest.mark.parametrize("job", [{"agent": {"enabled": True, "source": "inject", "interval_s": 0.5},
                                  "health": HEALTH, "workers": {"gpu_memory_mb": 4000}}], indirect=True)
def test_preflight_checks_free_memory_on_the_gpu_the_worker_got(job: ControllerJob) -> None:
    drill(job.tmp).write_text(
        '[baseline]\nmemory_total_mb = 81920\n\n'
        '[[fault]]\nnode = "node2"\ngpu = 1\nmemory_used_mb = 80000\nnote = "another tenant fills it"\n'
    )
    wait_for(lambda: job.status()["unknown_health_nodes"] == [], 30, "agents heard")
    with job.client() as c:
        c.wake_all()
    status = job.active(7, timeout_s=60)  # 8 GPUs, one too full for a worker
    assert ("node2", 1) not in gpus_with_workers(status)
    entry = next(g for g in status["cordoned_gpus"] if (g["node"], g["gpu"]) == ("node2", 1))
    assert entry["source"] == "preflight" and "MiB free" in entry["reason"]
