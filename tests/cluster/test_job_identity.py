"""A new job never adopts an earlier job's state directory that has the same job id (the bad-input
probe, on its own: tests/cluster/test_bad_input.py runs it with the others), and a job never
loses its own to a damaged record."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from slurm_elastic.devcluster.cluster import DevCluster
from slurm_elastic.errors import ControllerUnreachableError
from slurm_elastic.slurm.cli_backend import SlurmCli
from tests.cluster.bad_input import identity_probe
from tests.cluster.controller_harness import (
    ControllerJob,
    start_controller_job,
    stop_controller_job,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.second_cluster]


def test_an_earlier_jobs_directory_with_the_same_id_is_moved_aside(devcluster: DevCluster, tmp_path: Path) -> None:
    probe = identity_probe(devcluster, tmp_path)
    assert probe.ok, f"{probe.got}; {probe.kept}"


def test_a_restarted_controller_keeps_its_directory_when_job_json_is_damaged(devcluster: DevCluster,
                                                                               tmp_path: Path) -> None:
    """A damaged ``job.json`` under a live job: the restarted controller keeps the directory its own
    Slurm comment names (the queue, the token, the workers' records), where it moved it all aside."""
    job = start_controller_job(devcluster, tmp_path)
    try:
        with job.client() as c:
            c.scale(1)
            c.submit_group({"id": "kept", "worker_id": "0001", "policy_version": 0, "group_size": 4,
                            "sequences": [{"tokens": [1, 2, 3], "score": 0.5} for _ in range(4)]})
        job.active(1)
        token = (job.state_dir / "token").read_text()
        old_pid = job.controller_pid()
        wait_for(lambda: SlurmCli().job_info(job.job_id).comment.startswith("slurm-elastic:"), 30, "the job comment")
        (job.state_dir / "job.json").write_text('{"format": "slurm-elas')  # cut short
        os.kill(old_pid, signal.SIGKILL)  # the harness' loop starts another controller
        wait_for(lambda: _restarted(job, old_pid), 60, "a new controller")
        status = job.status()
        assert any("kept, and the record written again" in n for n in status["state_notes"]), status["state_notes"]
        assert status["queue"]["queued_sequences"] == 4 and (job.state_dir / "token").read_text() == token
        assert not list(tmp_path.glob(f"state-{job.job_id}.stale-*"))
        job.active(1)  # the worker goes on, adopted, with its token
    finally:
        stop_controller_job(job)


def _restarted(job: ControllerJob, old_pid: int) -> bool:
    try:
        return job.controller_pid() != old_pid and bool(job.status())
    except (ControllerUnreachableError, OSError, ValueError):
        return False
