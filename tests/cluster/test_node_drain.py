"""An admin drains a node under a running job (``scontrol update NodeName=node2 State=DRAIN``):
Slurm keeps new jobs off it but still starts steps there inside the job, so the controller reads the
nodes' states and acts: node2's GPUs are cordoned with the admin's reason, its workers finish their
rollout and leave, none comes back there until ``State=RESUME``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.devcluster.cluster import DevCluster
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import (
    burst_options,
    restart_slurmctld,
    start_controller_job,
    stop_controller_job,
    wait_for,
)

pytestmark = pytest.mark.cluster


def worker_nodes(job_id: int) -> list[str]:
    return sorted(s.nodes[0] for s in SlurmCli().list_steps(job_id) if s.name.startswith("se-w-"))


def test_a_node_an_admin_drains_is_emptied_and_used_again_once_resumed(devcluster: DevCluster, tmp_path: Path) -> None:
    job = start_controller_job(devcluster, tmp_path, workers={"initial_workers": 8},
                               autoscaler={"min_workers": 8, "max_workers": 8},
                               controller={"allocation_check_s": 1.0})
    try:
        status = job.active(8, timeout_s=60)
        on_node2 = {w["worker_id"] for w in status["workers"] if w["node"] == "node2" and w["state"] == "ACTIVE"}
        assert len(on_node2) == 4
        run_command(["scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=fan swap"])

        cordoned = wait_for(lambda: len((st := job.status())["cordoned_gpus"]) == 4 and st["cordoned_gpus"], 15,
                            "node2's GPUs to be cordoned")
        assert {(g["node"], g["source"]) for g in cordoned} == {("node2", "slurm")}
        assert all(g["reason"].startswith("Slurm marks node node2 ") and g["reason"].endswith("DRAIN: fan swap")
                   for g in cordoned), cordoned
        wait_for(lambda: worker_nodes(job.job_id) == ["node1"] * 4, 30, "node2's workers to leave")
        events = job.events()
        assert {e["worker"] for e in events if e["event"] == "drained"} >= on_node2, events[-10:]  # rollout finished
        assert not [e for e in events if e["event"] == "crash"]
        time.sleep(3.0)  # target 8, 4 GPUs usable: nothing goes back to node2
        assert worker_nodes(job.job_id) == ["node1"] * 4
        text = CliRunner().invoke(main, ["status", str(job.job_id)]).output
        assert "fan swap" in text, text

        run_command(["scontrol", "update", "NodeName=node2", "State=RESUME"])
        wait_for(lambda: job.status()["cordoned_gpus"] == [], 15, "node2's cordons to lift")
        job.active(8, timeout_s=60)
        assert worker_nodes(job.job_id) == ["node1"] * 4 + ["node2"] * 4
    finally:
        run_command(["scontrol", "update", "NodeName=node2", "State=RESUME"], check=False)  # if still drained
        stop_controller_job(job)


def test_with_release_drained_nodes_the_emptied_node_goes_back_to_slurm(devcluster: DevCluster,
                                                                       tmp_path: Path) -> None:
    job = start_controller_job(devcluster, tmp_path, workers={"initial_workers": 8},
                               autoscaler={"min_workers": 8, "max_workers": 8},
                               controller={"allocation_check_s": 1.0}, health={"release_drained_nodes": True})
    try:
        job.active(8, timeout_s=60)
        run_command(["scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=fan swap"])
        status = wait_for(lambda: (st := job.status())["left_nodes"] and st, 30, "node2 to go back to Slurm")
        assert [left["node"] for left in status["left_nodes"]] == ["node2"]
        assert SlurmCli().job_info(job.job_id).nodes == ("node1",)
        wait_for(lambda: devcluster.node_states()["node2"] == "drain", 15,  # drained: out of the job, nothing there
                 "node2 to be drained (not draining)")
        job.active(4, timeout_s=30)
        assert worker_nodes(job.job_id) == ["node1"] * 4
        assert not [e for e in job.events() if e["event"] == "crash"]
    finally:
        run_command(["scontrol", "update", "NodeName=node2", "State=RESUME"], check=False)
        stop_controller_job(job)
        restart_slurmctld(devcluster)  # else the next whole-node jobs wait minutes (controller_harness.py)


def burst_jobs_of(job_id: int) -> list[tuple[int, str]]:
    out = run_command(["squeue", "--me", f"--name=elastic-burst-{job_id}", "-h", "-o", "%i %T"]).stdout
    return [(int(i), s) for i, s in (line.split() for line in out.splitlines())]


def test_a_burst_job_on_a_drained_node_is_given_back_and_asked_for_again(devcluster: DevCluster,
                                                                         tmp_path: Path) -> None:
    job = start_controller_job(
        devcluster, tmp_path, nodes=1, gpus_per_node=4, controller={"allocation_check_s": 1.0},
        burst=burst_options(devcluster))
    try:
        with job.client() as c:
            c.scale(6)
        job.active(6, timeout_s=60)
        [(first, _state)] = burst_jobs_of(job.job_id)
        run_command(["scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=fan swap"])

        # its workers drain, it is cancelled (node2 goes back to Slurm, drained), another one waits
        [(second, state)] = wait_for(lambda: len(jobs := burst_jobs_of(job.job_id)) == 1 and jobs[0][0] != first
                                     and jobs, 30, "the burst job on node2 to be given back and another asked for")
        assert state == "PENDING"
        status = job.active(4, timeout_s=30)
        assert status["burst"]["lost"] == 0 and status["burst"]["submitted"] == 2
        assert not [e for e in job.events() if e["event"] == "crash"]

        run_command(["scontrol", "update", "NodeName=node2", "State=RESUME"])
        job.active(6, timeout_s=60)
        assert burst_jobs_of(job.job_id) == [(second, "RUNNING")]
    finally:
        run_command(["scontrol", "update", "NodeName=node2", "State=RESUME"], check=False)
        stop_controller_job(job)
        for burst_id, _state in burst_jobs_of(job.job_id):
            run_command(["scancel", str(burst_id)], check=False)


def test_a_burst_job_whose_every_gpu_is_cordoned_is_given_back_and_its_node_excluded(devcluster: DevCluster,
                                                                                    tmp_path: Path) -> None:
    """An operator cordons every GPU of the burst job's node and drains its workers: the job, with
    no GPU that could take a worker, is given back (it held them and max_jobs before), and the next
    one is asked for without that node (--exclude): here it waits, the only other node being ours."""
    job = start_controller_job(
        devcluster, tmp_path, nodes=1, gpus_per_node=4,
        burst=burst_options(devcluster))
    try:
        with job.client() as c:
            c.scale(6)
        status = job.active(6, timeout_s=60)
        [(first, _state)] = burst_jobs_of(job.job_id)
        burst_node = next(w["node"] for w in status["workers"] if w["job_id"] == first)
        with job.client() as c:
            for gpu in range(4):
                c.cordon(burst_node, gpu, "fan swap")
            for worker in status["workers"]:
                if worker["job_id"] == first:
                    c.drain(worker["worker_id"])
        [(second, state)] = wait_for(lambda: len(jobs := burst_jobs_of(job.job_id)) == 1 and jobs[0][0] != first
                                     and jobs, 60, "the burst job to be given back and another asked for")
        shown = run_command(["scontrol", "show", "job", str(second)]).stdout
        assert state == "PENDING" and f"ExcNodeList={burst_node}" in shown, shown
    finally:
        stop_controller_job(job)
        for burst_id, _state in burst_jobs_of(job.job_id):
            run_command(["scancel", str(burst_id)], check=False)
