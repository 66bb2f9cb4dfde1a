"""What an operator reads of a job with a burst job (a live probe's findings): with the controller
down, ``status`` lists the burst job and its worker steps as Slurm does, not the parent's steps
only; and a burst job its drain signal ended (``scancel --signal=TERM B``) is counted lost, not
cancelled as well, though the controller cancels it once empty."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from slurm_elastic.commands.jobs import _render, collect_status
from slurm_elastic.devcluster.cluster import DevCluster
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import (
    burst_options,
    start_controller_job,
    stop_controller_job,
    wait_for,
)
from tests.cluster.test_burst_controller import burst_jobs_of

pytestmark = [pytest.mark.cluster, pytest.mark.second_cluster]


def test_status_with_the_controller_down_lists_the_burst_job_and_a_signalled_job_is_lost_once(
        devcluster: DevCluster, tmp_path: Path) -> None:
    job = start_controller_job(devcluster, tmp_path, nodes=1, gpus_per_node=4,
                               burst=burst_options(devcluster, gpus_per_job=2))
    try:
        with job.client() as c:
            c.scale(6)
        status = job.active(6, timeout_s=60)
        [(burst_id, _state)] = burst_jobs_of(job)
        in_burst = {f"se-w-{w['worker_id']}" for w in status["workers"] if w["job_id"] == burst_id}
        assert len(in_burst) == 2
        pid = job.controller_pid()
        os.kill(pid, signal.SIGSTOP)  # down, but not restarted: status falls back on Slurm
        try:
            doc = collect_status(job.job_id)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert not doc["controller_reachable"]
        assert [(j["job_id"], j["state"]) for j in doc["slurm_burst_jobs"]] == [(burst_id, "RUNNING")]
        listed = {s["name"] for s in doc["slurm_steps"] if s["step_id"].startswith(f"{burst_id}.")}
        assert in_burst <= listed, doc["slurm_steps"]
        assert "burst jobs Slurm lists for it: 1" in _render(doc)

        run_command(["scancel", "--signal=TERM", str(burst_id)], check=False)  # 22.05: rc 225 after a --signal
        wait_for(lambda: job.status()["burst"]["lost"] == 1, 60, "the signalled burst job counted lost")
        burst = job.status()["burst"]
        assert (burst["lost"], burst["cancelled"]) == (1, 0), burst  # before: (1, 1)
    finally:
        stop_controller_job(job)
        for burst_job, _state in burst_jobs_of(job):
            run_command(["scancel", str(burst_job)], check=False)
