"""A trainer without GPUs (``job.trainer_gpus = 0``) through the rendered batch script: its step
names ``--gres=none``, so every GPU of its node takes a worker. Before, a step that names no GRES
held all of its node's (Slurm 22.05: ``TresPerNode=gres:gpu:4``) and no worker step ever started."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from slurm_elastic.client.control import ControlClient
from slurm_elastic.devcluster.cluster import DevCluster
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import FAKE_WORKER, REPO, _toml, locate_in, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.second_cluster]


def test_a_trainer_without_gpus_leaves_every_gpu_of_its_node_to_the_workers(devcluster: DevCluster,
                                                                            tmp_path: Path) -> None:
    config = {
        "job": {"name": "se-cpu-trainer", "nodes": 1, "gpus_per_node": 4, "output": str(tmp_path / "job.out"),
                "setup": f'export PATH="{Path(sys.executable).parent}:$PATH" PYTHONPATH={REPO}',
                "trainer_command": "sleep 300", "trainer_gpus": 0},
        "controller": {"tick_interval_s": 0.3, "state_dir": str(tmp_path / "state-{job_id}")},
        "workers": {"command": [sys.executable, str(FAKE_WORKER)], "initial_workers": 4, "heartbeat_interval_s": 0.3,
                    "env": {"FAKE_WORKER_LOG": str(tmp_path / "events.log"), "FAKE_GPU_DIR": str(devcluster.dir / "dev"),
                            "ROLLOUT_S": "0.5"}},
        "autoscaler": {"min_workers": 4, "max_workers": 4},
        "agent": {"enabled": False},
    }
    (tmp_path / "elastic.toml").write_text(_toml(config))
    script = run_command([sys.executable, "-m", "slurm_elastic", "render", "--config", str(tmp_path / "elastic.toml")]).stdout
    assert "--gres=none --job-name=se-trainer" in script
    (tmp_path / "job.sbatch").write_text(script)
    job_id = int(run_command(["sbatch", "--parsable", str(tmp_path / "job.sbatch")]).stdout.strip().split(";")[0])
    try:
        state_dir = tmp_path / f"state-{job_id}"
        url, token = wait_for(lambda: all((state_dir / f).exists() for f in ("token", "controller.json"))
                              and locate_in(state_dir, job_id), 60, "the controller's address")
        trainer = wait_for(lambda: next((s for s in SlurmCli().list_steps(job_id) if s.name == "se-trainer"), None),
                           60, "the trainer step")  # before: it waited for the GPUs the workers held, or they for it
        assert "gpu" not in trainer.tres_per_node, trainer
        with ControlClient(url, token) as client:
            wait_for(lambda: client.status()["workers_by_state"]["ACTIVE"] == 4, 60, "4 active workers")
            status = client.status()
            assert status["usable_slots"] == 4
            assert sorted(g for w in status["workers"] for g in w["gpus"]) == [0, 1, 2, 3], status["workers"]
    finally:
        run_command(["scancel", str(job_id)], check=False)
