"""An operator cancels a worker's step by hand (``scancel JOB.STEP``, or ``scancel --signal=TERM
JOB.STEP``, or kills its ``srun`` with SIGKILL): the worker is relaunched at once, the cancels
are not counted as crashes of its GPU (three within the crash window would cordon it), and what
the queue had admitted the killed step is released (its relaunch, under the same worker id,
starts with no lease)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import psutil
import pytest

from slurm_elastic.devcluster.cluster import DevCluster
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import start_controller_job, stop_controller_job, wait_for

LEASE_WORKER = Path(__file__).with_name("lease_worker.py")

pytestmark = [pytest.mark.cluster, pytest.mark.second_cluster]


def kill_its_srun(job_id: int, step_name: str) -> None:
    """SIGKILL to the controller's ``srun`` of a step (not the srun it forks): its shepherd cancels the step."""
    sruns = {p.pid: p for p in psutil.process_iter(["ppid", "cmdline"])
             if (p.info["cmdline"] or [""])[0].endswith("srun") and f"--jobid={job_id}" in p.info["cmdline"]
             and f"--job-name={step_name}" in p.info["cmdline"]}
    (launched,) = [p for p in sruns.values() if p.info["ppid"] not in sruns]
    launched.send_signal(signal.SIGKILL)


@pytest.mark.parametrize("how", [[], ["--signal=TERM"], ["srun"]], ids=["kill", "term", "srun-kill-9"])
def test_a_worker_step_cancelled_by_hand_three_times_leaves_its_gpu_uncordoned(devcluster: DevCluster,
                                                                                 tmp_path: Path, how: list[str]) -> None:
    job = start_controller_job(devcluster, tmp_path, workers={"initial_workers": 1},
                               autoscaler={"min_workers": 1, "max_workers": 1})
    try:
        job.active(1, timeout_s=60)
        for _ in range(3):
            (name, step_id), = job.worker_steps().items()
            if how == ["srun"]:
                kill_its_srun(job.job_id, name)
            else:
                run_command(["scancel", *how, f"{job.job_id}.{step_id}"], check=not how)  # 22.05: 225 after a --signal
            wait_for(lambda old=step_id, name=name: job.worker_steps().get(name) not in (None, old), 30,
                     "the worker's relaunch")
            job.active(1, timeout_s=30)

        status = job.status()
        assert status["cordoned_gpus"] == [], status["cordoned_gpus"]
        (worker,) = status["workers"]
        assert worker["crash_count"] == 0 and worker["launches"] == 4, worker
        log = (tmp_path / "job.out").read_text()
        assert log.count("ended (not counted against its GPU)") == 3 and " crashed on " not in log, log[-2000:]
    finally:
        stop_controller_job(job)


def test_a_killed_steps_admission_is_released_and_its_relaunch_starts_without_it(devcluster: DevCluster,
                                                                                tmp_path: Path) -> None:
    job = start_controller_job(devcluster, tmp_path, autoscaler={"min_workers": 1, "max_workers": 1},
                               workers={"initial_workers": 1, "command": [sys.executable, str(LEASE_WORKER)]},
                               queue={"batch_size": 8, "max_staleness": 1})

    def admitted() -> tuple[int, int]:
        queue = job.status()["queue"]
        return queue["running_rollouts"], queue["staleness_capacity"]

    try:
        job.active(1, timeout_s=60)
        wait_for(lambda: admitted() == (4, 12), 30, "the first step's admission")
        for _ in range(3):  # before the fix: 8, 12, 16 running, then no capacity left for anyone
            (name, step_id), = job.worker_steps().items()
            run_command(["scancel", f"{job.job_id}.{step_id}"])
            wait_for(lambda old=step_id, name=name: job.worker_steps().get(name) not in (None, old), 30,
                     "the worker's relaunch")
            job.active(1, timeout_s=30)
            wait_for(lambda: admitted() == (4, 12), 30, "the relaunch's own admission, and no more")
        assert "released 4 admitted sequences" in (tmp_path / "job.out").read_text()
    finally:
        stop_controller_job(job)
