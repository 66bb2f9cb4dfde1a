"""A job suspended for longer than the heartbeat grace (``scontrol suspend``, as an operator or gang
scheduling does) and resumed: its workers are not taken for hung, and none is relaunched."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from slurm_elastic.devcluster.cluster import DevCluster
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import start_controller_job, stop_controller_job, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.second_cluster]

GRACE_S = 4.0
STOPPED_S = 12.0  # suspended this long


def test_a_job_stopped_past_the_heartbeat_grace_keeps_its_workers(devcluster: DevCluster, tmp_path: Path) -> None:
    job = start_controller_job(devcluster, tmp_path, workers={"initial_workers": 4, "heartbeat_grace_s": GRACE_S},
                               autoscaler={"min_workers": 4, "max_workers": 4})
    try:
        job.active(4, timeout_s=60)
        steps = job.worker_steps()

        run_command(["scontrol", "suspend", str(job.job_id)])
        time.sleep(STOPPED_S)
        run_command(["scontrol", "resume", str(job.job_id)])

        wait_for(lambda: job.status()["ticks"], 10, "the controller to answer again")
        time.sleep(GRACE_S)  # long enough for a worker taken for hung to be cancelled
        status = job.active(4, timeout_s=30)
        assert job.worker_steps() == steps, "workers were relaunched"
        assert all(w["crash_count"] == 0 for w in status["workers"]), status["workers"]
        log = (tmp_path / "job.out").read_text()
        assert "the controller did not run for" in log and "no heartbeat for" not in log, log[-2000:]
    finally:
        stop_controller_job(job)
