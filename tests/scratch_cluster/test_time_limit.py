"""A real time limit, on a cluster of its own (it runs beside the tests that share the dev
cluster): a 2-minute job's workers all drain before Slurm ends it, each finishing its rollout,
none counted as a crash, none launched after, and `status` says why."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec
from slurm_elastic.status_view import render_status
from tests.cluster.controller_harness import start_controller_job, stop_controller_job, wait_for

pytestmark = pytest.mark.cluster


def test_before_the_time_limit_every_worker_drains_and_none_is_launched() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="se-limit-"))  # short: slurmstepd's sockets live under it
    cluster = DevCluster(DevClusterSpec(dir=tmp / "cluster", nodes=1, gpus_per_node=2, ctld_port=26817,
                                        node_base_port=26901, cluster_name="timelimit", node_prefix="tl",
                                        first_job_id=2_000_000))
    saved = os.environ.get("SLURM_CONF")
    try:
        cluster.up(wait_s=90)
        os.environ["SLURM_CONF"] = str(cluster.conf_path)
        # a 120 s job: the drain begins a quarter of it (30 s) before its end, end_drain_s being 60
        job = start_controller_job(cluster, tmp / "job", nodes=1, gpus_per_node=2, sbatch_options=("--time=2",),
                                   workers={"initial_workers": 2, "end_drain_s": 60.0, "drain_timeout_s": 20.0},
                                   autoscaler={"enable_elastic": False})
        try:
            job.active(2, timeout_s=60)
            assert job.status()["last_decision"]["action"] != "drain"
            status = wait_for(lambda: (s := job.status())["last_decision"]["action"] == "drain" and s, 120,
                              "the drain before the time limit")
            assert "capped at a quarter of the job's 120 s: 30 s" in status["last_decision"]["reason"], status["last_decision"]
            wait_for(lambda: not job.worker_steps(), 30, "every worker step to end")
            status = wait_for(lambda: (s := job.status())["workers_by_state"]["INACTIVE"] == 2 and s, 20,
                              "both workers ended")
            ended = status["ended_workers"]
            assert len(ended) == 2 and all(w["reason"].endswith("step ended after drain") for w in ended), ended
            assert all(w["crash_count"] == 0 and w["launches"] == 1 for w in status["workers"]), status["workers"]
            text = render_status(job.job_id, {"controller": status})
            assert "target: 0 workers (draining before the job's time limit; then 2)" in text, text
        finally:
            stop_controller_job(job)
    finally:
        if saved is not None:
            os.environ["SLURM_CONF"] = saved
        cluster.down()
        shutil.rmtree(tmp, ignore_errors=True)
