"""A node of a running job fails (set DOWN in Slurm): with ``--no-kill``, as the example's batch
script asks, the job runs on with the other node and the controller stops using the one that left."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.devcluster.cluster import DevCluster
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import (
    restart_slurmctld,
    start_controller_job,
    stop_controller_job,
    wait_for,
)

pytestmark = pytest.mark.cluster


def test_a_failed_node_leaves_the_job_running_on_the_other(devcluster: DevCluster, tmp_path: Path) -> None:
    job = start_controller_job(devcluster, tmp_path, workers={"initial_workers": 8},
                               autoscaler={"min_workers": 8, "max_workers": 8}, sbatch_options=("--no-kill",))
    try:
        job.active(8, timeout_s=60)
        run_command(["scontrol", "update", "nodename=node2", "state=down", "reason=test_node_failure"])

        status = wait_for(lambda: (st := job.status())["left_nodes"] and st, 30, "node2 to leave the job")
        assert [left["node"] for left in status["left_nodes"]] == ["node2"]
        wait_for(lambda: job.status()["workers_by_state"]["ACTIVE"] == 4, 30, "the 4 workers on node1")
        steps = [s for s in SlurmCli().list_steps(job.job_id) if s.name.startswith("se-w-")]
        assert len(steps) == 4 and all(s.nodes == ("node1",) for s in steps), steps
        assert SlurmCli().job_info(job.job_id).is_running
        result = CliRunner().invoke(main, ["status", str(job.job_id)])
        assert "node node2 left the job" in result.output and "its 4 GPUs get no more workers" in result.output, \
            result.output
    finally:
        stop_controller_job(job)
        run_command(["scontrol", "update", "nodename=node2", "state=resume"], check=False)  # if not back already
        restart_slurmctld(devcluster)  # else the next whole-node jobs wait minutes (controller_harness.py)
