"""``scontrol suspend`` of a burst job with workers mid-rollout, then ``scontrol resume``: the
workers stand SUSPENDED with their admissions counted in flight, survive a kill -9 of the
controller, and go on as they were when the job runs again: the same steps, not relaunched, their
rollouts accepted under the admissions they kept. The staleness counts are AReaL's throughout, and
no rollout is lost or counted twice. Suspended again and left so for the admission TTL, the job is
given back by the controller, and takes its workers' admissions with it when Slurm lists it no
more."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.devcluster.cluster import DevCluster
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import (
    ControllerJob,
    burst_options,
    start_controller_job,
    stop_controller_job,
    wait_for,
)
from tests.cluster.test_queue_api import client, group

pytestmark = [pytest.mark.cluster, pytest.mark.second_cluster]
TTL_S = 10  # the admission TTL: a job suspended this long is given back
QUEUE = {"batch_size": 8, "capacity_seqs": 100, "max_staleness": 0, "max_concurrent": 100, "admission_ttl_s": TTL_S}


def burst_jobs_of(job: ControllerJob) -> list[tuple[int, str]]:
    out = run_command(["squeue", "--me", f"--name=elastic-burst-{job.job_id}", "-h", "-o", "%i %T"]).stdout
    return [(int(i), s) for i, s in (line.split() for line in out.splitlines())]


def _answers(job: ControllerJob) -> bool:
    try:
        return bool(job.status())
    except Exception:
        return False


def counts(job: ControllerJob) -> tuple[int, int, int]:
    queue: dict[str, Any] = job.status()["queue"]
    return queue["running_rollouts"], queue["staleness_capacity"], queue["queued_sequences"]


def test_a_suspended_burst_jobs_workers_keep_their_admissions_and_go_on_when_it_resumes(
        devcluster: DevCluster, tmp_path: Path) -> None:
    job = start_controller_job(
        devcluster, tmp_path, nodes=1, gpus_per_node=4, sbatch_options=(f"--nodelist={devcluster.spec.node_names()[0]}",),
        health={"crash_threshold": 1}, queue=QUEUE, worker_env={"ROLLOUT_S": "3"},
        burst=burst_options(devcluster))  # max_jobs 1: no replacement, the suspended job is waited for
    try:
        with job.client() as c:
            c.scale(6)
        status = job.active(6, timeout_s=60)
        [(burst_id, _state)] = burst_jobs_of(job)
        in_burst = {w["worker_id"]: w["step_id"] for w in status["workers"] if w["job_id"] == burst_id}
        own = next(w["worker_id"] for w in status["workers"] if w["job_id"] != burst_id)
        assert len(in_burst) == 2
        with client(job) as c:  # each burst worker starts a rollout of 4: AReaL's bound (0 + 1 + 0) * 8 is reached
            assert [c.admit(4, w)["granted"] for w in in_burst] == [4, 4]
        assert counts(job) == (8, 0, 0)

        run_command(["scontrol", "suspend", str(burst_id)])
        suspended_at = time.time()
        wait_for(lambda: {w["worker_id"]: w["state"] for w in job.status()["workers"] if w["worker_id"] in in_burst}
                 == dict.fromkeys(in_burst, "SUSPENDED"), 30, "both burst workers SUSPENDED")
        pid = job.controller_pid()
        os.kill(pid, signal.SIGKILL)  # a restart while the job stands: the records and the leases are found again
        wait_for(lambda: job.controller_pid() != pid and _answers(job), 60, "a new controller")
        assert {w["worker_id"]: w["state"] for w in job.status()["workers"] if w["worker_id"] in in_burst} \
            == dict.fromkeys(in_burst, "SUSPENDED")
        assert counts(job) == (8, 0, 0)
        with client(job) as c:
            assert c.admit(4, own)["granted"] == 0  # their room is not handed to another worker
        status = job.status()
        assert [g for g in status["cordoned_gpus"] if g["source"] == "crash"] == [] and status["burst"]["lost"] == 0

        run_command(["scontrol", "resume", str(burst_id)])
        stood_s = time.time() - suspended_at
        status = job.active(6, timeout_s=30)
        back = {w["worker_id"]: w for w in status["workers"] if w["job_id"] == burst_id}
        assert {w: v["step_id"] for w, v in back.items()} == in_burst  # the same steps
        assert all(v["launches"] == 1 and v["history"][-1][2] == "ACTIVE" for v in back.values()), back
        with client(job) as c:
            for worker_id in in_burst:
                assert c.submit_group({**group(f"g-{worker_id}"), "worker_id": worker_id}) == {"accepted": True}
            assert c.submit_group({**group(f"g-{next(iter(in_burst))}"), "worker_id": next(iter(in_burst))}) \
                == {"accepted": False}  # a resend is stored once
        assert counts(job) == (0, 0, 8)  # taken from their leases: AReaL's counts, nothing unadmitted
        with client(job) as c:
            batch = c.pull_batch()
        assert batch is not None and sorted(g["id"] for g in batch["groups"]) == sorted(f"g-{w}" for w in in_burst)

        events = job.events()
        for worker_id in in_burst:  # started once (not relaunched); the rollout it was in when stopped went on
            mine = [e for e in events if e["worker"] == worker_id]
            assert sum(e["event"] == "start" for e in mine) == 1
            begun = {e["n"]: e["t"] for e in mine if e["event"] == "rollout_begin"}
            ended = {e["n"]: e["t"] for e in mine if e["event"] == "rollout_end"}
            assert list(begun) == list(range(1, len(begun) + 1)) and list(ended) == list(range(1, len(ended) + 1))
            assert len(begun) - len(ended) <= 1
            assert max(ended[n] - begun[n] for n in ended) > stood_s - 2, (stood_s, begun, ended)
        burst = job.status()["burst"]
        assert (burst["submitted"], burst["lost"], burst["cancelled"]) == (1, 0, 0), burst

        with client(job) as c:  # suspended again and left so: the controller gives the job back at the TTL
            c.set_version(1)
            assert [c.admit(4, w)["granted"] for w in in_burst] == [4, 4]
        run_command(["scontrol", "suspend", str(burst_id)])
        wait_for(lambda: [w for w in job.status()["workers"] if w["state"] == "SUSPENDED"], 30, "SUSPENDED workers")
        assert counts(job)[0] == 8
        wait_for(lambda: burst_id not in [j for j, _ in burst_jobs_of(job)] and counts(job)[0] == 0, 60,
                 "the job given back and its workers' admissions released")
        status = job.status()
        ended = {w["worker_id"]: w["reason"] for w in status["ended_workers"] if w["worker_id"] in in_burst}
        assert set(ended) == set(in_burst), ended
        assert (status["burst"]["cancelled"], status["burst"]["lost"]) == (1, 0), status["burst"]
    finally:
        stop_controller_job(job)
        for left, _state in burst_jobs_of(job):
            run_command(["scancel", str(left)], check=False)
