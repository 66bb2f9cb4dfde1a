"""``scancel --signal=USR1 JOB`` (the whole job, not one step) through the rendered batch script:
the workers drain and are replaced, while the trainer step, which handles no signal, and the GPU
agents run on (before, both died: USR1 ends a process that does not handle it). With ``--full``
the batch script gets it too, and runs on."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from slurm_elastic.client.control import ControlClient
from slurm_elastic.devcluster.cluster import DevCluster
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import FAKE_WORKER, REPO, _toml, locate_in, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.second_cluster]


def steps_by_name(job_id: int) -> dict[str, str]:
    return {s.name: s.step_id for s in SlurmCli().list_steps(job_id)}


def test_usr1_to_the_whole_job_drains_the_workers_and_spares_the_trainer_and_agents(devcluster: DevCluster,
                                                                                   tmp_path: Path) -> None:
    trainer_log = tmp_path / "trainer.log"
    config = {
        "job": {"name": "se-usr1", "nodes": 2, "gpus_per_node": 4, "output": str(tmp_path / "job.out"),
                "setup": f'export PATH="{Path(sys.executable).parent}:$PATH" PYTHONPATH={REPO}',
                "trainer_command": f"{sys.executable} {REPO}/tests/cluster/plain_trainer.py {trainer_log}",
                "trainer_gpus": 1},
        "controller": {"tick_interval_s": 0.3, "state_dir": str(tmp_path / "state-{job_id}")},
        "workers": {"command": [sys.executable, str(FAKE_WORKER)], "initial_workers": 2, "heartbeat_interval_s": 0.3,
                    "heartbeat_grace_s": 8.0, "drain_timeout_s": 8.0,
                    "env": {"FAKE_WORKER_LOG": str(tmp_path / "events.log"), "FAKE_GPU_DIR": str(devcluster.dir / "dev"),
                            "ROLLOUT_S": "0.5"}},
        "autoscaler": {"min_workers": 2, "max_workers": 2},
        "agent": {"enabled": True, "source": "inject", "inject_file": str(tmp_path / "drill.toml"), "interval_s": 1.0},
    }
    (tmp_path / "elastic.toml").write_text(_toml(config))
    script = run_command([sys.executable, "-m", "slurm_elastic", "render", "--config", str(tmp_path / "elastic.toml")]).stdout
    (tmp_path / "job.sbatch").write_text(script)
    job_id = int(run_command(["sbatch", "--parsable", str(tmp_path / "job.sbatch")]).stdout.strip().split(";")[0])
    try:
        state_dir = tmp_path / f"state-{job_id}"
        before = wait_for(lambda: (s := steps_by_name(job_id)) and "se-trainer" in s
                          and sum(n.startswith("se-agent") for n in s) == 2
                          and sum(n.startswith("se-w-") for n in s) == 2 and s, 90, "trainer, 2 agents, 2 workers")
        url, token = wait_for(lambda: all((state_dir / f).exists() for f in ("token", "controller.json"))
                              and locate_in(state_dir, job_id), 30, "the controller's address")
        with ControlClient(url, token) as client:
            wait_for(lambda: client.status()["workers_by_state"]["ACTIVE"] == 2, 60, "2 active workers")

            run_command(["scancel", "--signal=USR1", str(job_id)], check=False)  # 22.05: rc 225 after a --signal
            old_workers = {n for n in before if n.startswith("se-w-")}
            wait_for(lambda: not old_workers & set(steps_by_name(job_id)), 30, "the workers to drain")
            wait_for(lambda: client.status()["workers_by_state"]["ACTIVE"] == 2, 60, "2 new active workers")
            lines_then = len(trainer_log.read_text().splitlines())
            time.sleep(1.0)

            after = steps_by_name(job_id)
            assert after["se-trainer"] == before["se-trainer"]  # the same trainer step, still running
            assert len(trainer_log.read_text().splitlines()) > lines_then
            assert {n: s for n, s in after.items() if n.startswith("se-agent")} == {
                n: s for n, s in before.items() if n.startswith("se-agent")}
            workers = client.status()["workers"]  # the drained two are gone from it: new ones run
            assert {f"se-w-{w['worker_id']}" for w in workers}.isdisjoint(old_workers), workers
            assert all(w["crash_count"] == 0 and w["launches"] == 1 for w in workers), workers
            ended = [w for w in client.status()["ended_workers"] if f"se-w-{w['worker_id']}" in old_workers]
            assert len(ended) == 2 and all(  # their wrappers told the controller: drained, not "exited cleanly"
                w["reason"] == "drained (the drain signal reached its step (SIGUSR1: scancel --signal, or Slurm's "
                               "--signal)); step ended after drain" for w in ended), ended

            run_command(["scancel", "--full", "--signal=USR1", str(job_id)], check=False)  # the batch script too
            time.sleep(2.0)
            assert client.status()["workers_by_state"]  # the controller answers
            assert steps_by_name(job_id)["se-trainer"] == before["se-trainer"]
    finally:
        run_command(["scancel", str(job_id)], check=False)
        wait_for(lambda: not run_command(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip(),
                 60, "job to end")
