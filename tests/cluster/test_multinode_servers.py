"""Servers bigger than one node on the dev cluster (2 nodes x 4 fake GPUs): an 8-GPU server is one
step over both nodes with one endpoint (task 0's), serves, drains (the signal reaches both tasks),
a lost task on the second node is a crash of the whole worker, and an operator's SIGTERM to the
step is not; 2-GPU servers take a pair of
GPUs each, two per node."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from slurm_elastic.router import Router
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import ControllerJob, locate_in, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.second_cluster]
FAKE_SERVER = str(Path(__file__).with_name("fake_server.py"))


def servers(gpus_per_worker: int) -> dict[str, object]:
    return {"workers": {"kind": "server", "command": [sys.executable, FAKE_SERVER, "{port}"],
                        "gpus_per_worker": gpus_per_worker, "readiness_path": "/health",
                        "server_drain_grace_s": 0.2, "drain_timeout_s": 20.0},
            "worker_env": {"GEN_S": "0.05"}}


def by_event(job: ControllerJob, kind: str) -> list[dict[str, object]]:
    return [e for e in job.events() if e["event"] == kind]


@pytest.mark.parametrize("job", [servers(8)], indirect=True)
def test_an_8_gpu_server_spans_both_nodes_registers_once_serves_and_drains(job: ControllerJob) -> None:
    with job.client() as c:
        c.scale(3)  # only one fits: it takes every GPU of both nodes
        status = job.active(1)
        worker = status["workers"][0]
        nodes = sorted(worker["nodes"])
        assert worker["worker_id"] == "0001" and sorted(worker["nodes"]) == nodes and len(nodes) == 2
        steps = [s for s in SlurmCli().list_steps(job.job_id) if s.name.startswith("se-w-")]
        assert [(s.name, sorted(s.nodes)) for s in steps] == [("se-w-0001", nodes)]  # one step, both nodes
        starts = wait_for(lambda: len(by_event(job, "start")) == 2 and by_event(job, "start"), 20, "both tasks")
        assert sorted((e["rank"], e["node"]) for e in starts) == [(0, worker["node"]), (1, worker["nodes"][1])]
        assert all(len(str(e["gpus"]).split(",")) == 4 for e in starts)  # 4 GPUs on each node
        other = worker["nodes"][1]
        reported = wait_for(lambda: job.status()["workers"][0]["node_gpus"].get(other), 20, "rank 1's GPUs")
        assert sorted(reported) == [0, 1, 2, 3] and len(worker["gpus"]) == 4
        endpoints = job.status()["servers"]["endpoints"]
        assert [e["worker_id"] for e in endpoints] == ["0001"]  # one endpoint: rank 0's
        url, token = locate_in(job.state_dir, job.job_id)
        with Router(url, token, state_dir=job.state_dir, report_interval_s=0.2, poll_wait_s=5.0) as router:
            router.wait_for_endpoints(1, timeout_s=20)
            replies = [router.request("POST", "/generate", json={"id": i}).json()["worker"] for i in range(5)]
        assert replies == ["0001"] * 5
        assert all(e["rank"] == 0 for e in by_event(job, "request_begin"))
        assert len(job.status()["workers"]) == 1  # rank 1 never became a worker of its own
        c.scale(0)
        job.active(0)
    drained = wait_for(lambda: len(by_event(job, "drained")) == 2 and by_event(job, "drained"), 20, "both drained")
    assert sorted(e["rank"] for e in drained) == [0, 1]  # scancel --signal reached both tasks
    wait_for(lambda: not job.worker_steps(), 20, "the step to end")
    history = job.status()["workers"]
    assert history == [] or all(w["state"] == "INACTIVE" for w in history)


@pytest.mark.parametrize("job", [servers(8)], indirect=True)
def test_an_8_gpu_server_that_loses_its_second_nodes_task_crashes_and_an_operators_sigterm_does_not(
        job: ControllerJob) -> None:
    """A task that fails by itself is a crash of the whole worker, however rank 0 then reports srun's
    SIGTERM; ``scancel --signal=TERM J.S`` reaches both tasks as srun's SIGTERM would, and no task
    failed by itself, so it is a cancel."""
    with job.client() as c:
        c.scale(1)
        job.active(1)
        second = wait_for(lambda: [e for e in by_event(job, "start") if e["rank"] == 1], 20, "rank 1")[0]
        os.kill(int(second["pid"]), signal.SIGKILL)  # the engine's process on the second node dies
        crashed = wait_for(lambda: (w := job.status()["workers"]) and w[0]["crash_count"] == 1 and w[0], 30,
                           "the crash")
        assert any("its task 1 exited with code -9" in h[3] for h in crashed["history"]), crashed["history"]
        job.active(1, timeout_s=40)  # relaunched after its backoff (same id, both nodes again)

        (name, step_id), = job.worker_steps().items()
        run_command(["scancel", "--signal=TERM", f"{job.job_id}.{step_id}"], check=False)  # 22.05: rc 225
        wait_for(lambda: job.worker_steps().get(name) not in (None, step_id), 30, "the relaunch")
        (worker,) = job.active(1, timeout_s=30)["workers"]
        assert worker["crash_count"] == 1 and worker["launches"] == 3, worker  # the cancel is not counted
        assert any("cancelled by someone else" in h[3] for h in worker["history"]), worker["history"]
        c.scale(0)
        job.active(0)


@pytest.mark.parametrize("job", [servers(2)], indirect=True)
def test_2_gpu_servers_take_a_pair_of_gpus_each_two_per_node(job: ControllerJob) -> None:
    with job.client() as c:
        c.scale(5)  # 4 fit: 8 GPUs, 2 each
        status = job.active(4)
        workers = status["workers"]
        assert all(len(w["nodes"]) == 1 and len(w["gpus"]) == 2 for w in workers)
        per_node: dict[str, list[int]] = {}
        for w in workers:
            per_node.setdefault(w["node"], []).extend(w["gpus"])
        assert sorted(len(g) for g in per_node.values()) == [4, 4]
        assert all(sorted(g) == [0, 1, 2, 3] for g in per_node.values())  # disjoint pairs
        assert len(status["servers"]["endpoints"]) == 4
        c.scale(0)
        job.active(0)


@pytest.mark.parametrize("job", [{**servers(1), "workers": {**servers(1)["workers"], "tasks_per_node": 2}}],
                         indirect=True)
def test_a_second_task_on_a_one_node_worker_runs_its_command(job: ControllerJob) -> None:
    """Before (a live audit), task 1's registration was refused ("its step spans one node"): its
    wrapper retried for 300 s without running the command, then the step was cancelled."""
    with job.client() as c:
        c.scale(1)
        worker = job.active(1)["workers"][0]
        starts = wait_for(lambda: len(by_event(job, "start")) == 2 and by_event(job, "start"), 30, "both tasks")
        assert sorted((e["rank"], e["node"]) for e in starts) == [(0, worker["node"]), (1, worker["node"])]
        assert len(job.status()["workers"]) == 1 and len(worker["gpus"]) == 1
        c.scale(0)
        job.active(0)
    drained = wait_for(lambda: len(by_event(job, "drained")) == 2 and by_event(job, "drained"), 20, "both drained")
    assert sorted(e["rank"] for e in drained) == [0, 1]


@pytest.mark.parametrize("job", [servers(8)], indirect=True)
def test_a_cordon_on_the_second_node_keeps_the_8_gpu_server_off_until_lifted(job: ControllerJob) -> None:
    first, second = job.cluster.spec.node_names()
    with job.client() as c:
        c.cordon(second, 1, "fan noise")
        c.scale(1)
        ticks = job.status()["ticks"]
        wait_for(lambda: job.status()["ticks"] >= ticks + 5, 20, "five ticks")
        assert job.status()["workers"] == [] and job.worker_steps() == {}  # no slot: the second has 3 usable GPUs
        c.uncordon(second, 1)
        worker = job.active(1)["workers"][0]
        assert sorted(worker["nodes"]) == [first, second]
        c.scale(0)
        job.active(0)


@pytest.mark.parametrize("job", [servers(8)], indirect=True)
def test_kill_9_of_the_controller_reattaches_the_2_node_step_without_a_relaunch(job: ControllerJob) -> None:
    with job.client() as c:
        c.scale(1)
        job.active(1)
    wait_for(lambda: job.status()["workers"][0]["node_gpus"], 20, "rank 1's GPUs")
    job.status()  # the report is saved with the record
    steps = job.worker_steps()
    old_pid = job.controller_pid()
    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: job.controller_pid() != old_pid, 30, "a new controller")
    worker = job.active(1, timeout_s=40)["workers"][0]
    assert sorted(worker["nodes"]) == job.cluster.spec.node_names() and worker["launches"] == 1
    assert sorted(worker["node_gpus"].get(worker["nodes"][1], [])) == [0, 1, 2, 3]
    assert job.worker_steps() == steps and len(by_event(job, "start")) == 2  # same step, nothing relaunched
    with job.client() as c:
        c.scale(0)
        job.active(0)
