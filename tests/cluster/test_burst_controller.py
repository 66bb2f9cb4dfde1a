"""The controller with burst jobs on the dev cluster: a job holding node1 only scales past its 4
GPUs into a burst job on node2 and back; a kill -9 with a burst job running adopts it; ``stop``
and a cancelled parent leave no burst job."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.devcluster.cluster import DevCluster
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import (
    ControllerJob,
    burst_options,
    start_controller_job,
    stop_controller_job,
    wait_for,
)

pytestmark = pytest.mark.cluster


def burst_jobs_of(job: ControllerJob) -> list[tuple[int, str]]:
    out = run_command(["squeue", "--me", f"--name=elastic-burst-{job.job_id}", "-h", "-o", "%i %T"]).stdout
    return [(int(i), s) for i, s in (line.split() for line in out.splitlines())]


@pytest.fixture
def parent(devcluster: DevCluster, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ControllerJob]:
    """A controller job holding one node (4 GPUs), allowed one 4-GPU burst job in the scavenger
    partition (more options via indirect parametrize)."""
    job = start_controller_job(
        devcluster, tmp_path, nodes=1, gpus_per_node=4,
        burst=burst_options(devcluster),
        **getattr(request, "param", {}))
    yield job
    stop_controller_job(job)
    for burst_id, _state in burst_jobs_of(job):
        run_command(["scancel", str(burst_id)], check=False)


def test_scale_past_the_allocation_into_a_burst_job_and_back(parent: ControllerJob) -> None:
    with parent.client() as c:
        c.scale(6)
    status = parent.active(6, timeout_s=60)
    [(burst_id, state)] = burst_jobs_of(parent)
    assert state == "RUNNING"
    in_burst = [w for w in status["workers"] if w["job_id"] == burst_id]
    assert len(in_burst) == 2 and {w["node"] for w in in_burst} != {w["node"] for w in status["workers"]
                                                                     if w["job_id"] == parent.job_id}
    rows = status["burst_jobs"]
    assert [(r["job_id"], r["state"], r["gpus"], r["workers"]) for r in rows] == [(burst_id, "RUNNING", 4, 2)]
    with parent.client() as c:
        c.scale(2)
    parent.active(2, timeout_s=60)
    wait_for(lambda: not burst_jobs_of(parent), 60, "the burst job to be given back")
    final = parent.status()
    assert all(w["job_id"] == parent.job_id for w in final["workers"] if w["state"] == "ACTIVE")
    assert final["burst"]["lost"] == 0 and final["burst"]["submitted"] == 1


def test_a_killed_controller_adopts_its_burst_job_and_submits_no_second(parent: ControllerJob) -> None:
    with parent.client() as c:
        c.scale(6)
    parent.active(6, timeout_s=60)
    [(burst_id, _state)] = burst_jobs_of(parent)
    pid = parent.controller_pid()
    os.kill(pid, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        try:
            return parent.status() if parent.controller_pid() != pid else None
        except Exception:
            return None
    wait_for(restarted, 60, "the controller to restart")
    status = parent.active(6, timeout_s=60)
    assert [j for j, _ in burst_jobs_of(parent)] == [burst_id]  # adopted, not duplicated
    assert [r["job_id"] for r in status["burst_jobs"]] == [burst_id]
    assert sum(1 for w in status["workers"] if w["job_id"] == burst_id) == 2
    assert status["burst"]["submitted"] == 1 and status["burst"]["gpu_s_held"] > 0  # counted on from state.json


def test_a_preempted_burst_job_drains_its_workers_and_loses_no_rollout(parent: ControllerJob) -> None:
    with parent.client() as c:
        c.scale(6)
    status = parent.active(6, timeout_s=60)
    [(burst_id, _state)] = burst_jobs_of(parent)
    in_burst = {w["worker_id"] for w in status["workers"] if w["job_id"] == burst_id}
    node = next(w["node"] for w in status["workers"] if w["job_id"] == burst_id)
    urgent = run_command(["sbatch", "--parsable", f"--partition={parent.cluster.spec.urgent_partition}",
                          f"--nodelist={node}", "--gres=gpu:4", "--output=/dev/null", "--job-name=se-urgent",
                          "--wrap", "sleep 60"]).stdout.strip().split(";")[0]
    try:
        def drained() -> dict[str, dict[str, Any]]:
            return {e["worker"]: e for e in parent.events() if e["event"] == "drained" and e["worker"] in in_burst}
        done = wait_for(lambda: len(drained()) == 2 and drained(), 30, "the burst workers to drain")
        for worker_id, event in done.items():  # each finished the rollout it had begun: none cut short
            ends = [e["n"] for e in parent.events() if e["worker"] == worker_id and e["event"] == "rollout_end"]
            assert max(ends) == event["rollouts"]
        wait_for(lambda: parent.status()["burst"]["lost"] == 1, 60, "the preempted burst job to be counted")
        # the allocation keeps its own; the two the target still asks for may wait in BACKOFF for a burst
        # job that the urgent one holds back (its replacement is pending), as on a loaded host
        def own_four() -> dict[str, Any] | None:
            st = parent.status()
            active = [w for w in st["workers"] if w["state"] == "ACTIVE"]
            ok = len(active) == 4 and all(w["job_id"] == parent.job_id for w in active)
            return st if ok and st["workers_by_state"]["STARTING"] == st["workers_by_state"]["DRAINING"] == 0 else None
        wait_for(own_four, 30, "the allocation's 4 workers ACTIVE")
    finally:
        run_command(["scancel", urgent], check=False)


def test_the_drain_signal_to_a_burst_job_ends_it_and_no_worker_goes_there_again(parent: ControllerJob) -> None:
    """``scancel --signal=USR1 BURSTJOB`` (an operator; Slurm's ``--signal`` before the time limit
    reads the same): its workers drain, the job is counted lost and given back once empty, and new
    workers go to a new burst job. Before, workers that drained within a tick left no mark: two
    new ones were launched into the same job at once."""
    with parent.client() as c:
        c.scale(6)
    parent.active(6, timeout_s=60)
    [(burst_id, _state)] = burst_jobs_of(parent)
    run_command(["scancel", "--signal=USR1", str(burst_id)], check=False)  # 22.05: rc 225 after a --signal
    wait_for(lambda: burst_id not in [j for j, _ in burst_jobs_of(parent)], 60, "the drained burst job given back")
    wait_for(lambda: parent.status()["burst"]["lost"] == 1, 30, "the ended burst job counted lost")  # not requeued
    status = parent.active(6, timeout_s=60)  # in a new burst job
    assert all(w["job_id"] != burst_id for w in status["workers"]), status["workers"]


def test_a_burst_job_on_hold_is_not_waited_for_and_is_cancelled_once_another_covers_the_target(
        devcluster: DevCluster, tmp_path: Path) -> None:
    """``scontrol hold`` on a pending burst job: the pool asks for another (within ``max_jobs``),
    and once that one runs the workers wanted, the held one is cancelled, not left in the queue."""
    blocker = run_command(["sbatch", "--parsable", "--nodelist=node2", "--gres=gpu:4", "--output=/dev/null",
                           "--job-name=se-blocker", "--wrap", "sleep 300"]).stdout.strip().split(";")[0]
    job = start_controller_job(
        devcluster, tmp_path, nodes=1, gpus_per_node=4, sbatch_options=("--nodelist=node1",),
        burst=burst_options(devcluster, max_jobs=2))
    try:
        with job.client() as c:
            c.scale(6)  # 4 in the allocation, 2 beyond it: node2 is taken, so the burst job waits
        [(held, _state)] = wait_for(lambda: burst_jobs_of(job) or None, 30, "a pending burst job")
        run_command(["scontrol", "hold", str(held)])
        jobs = wait_for(lambda: len(b := burst_jobs_of(job)) == 2 and b, 30, "a second burst job beside the held one")
        [other] = [j for j, _ in jobs if j != held]
        run_command(["scancel", blocker])
        status = job.active(6, timeout_s=60)
        assert sum(w["job_id"] == other for w in status["workers"]) == 2
        wait_for(lambda: [j for j, _ in burst_jobs_of(job)] == [other], 30, "the held burst job cancelled")
        assert job.status()["burst"]["submitted"] == 2
    finally:
        run_command(["scancel", blocker], check=False)
        stop_controller_job(job)
        for burst_id, _state in burst_jobs_of(job):
            run_command(["scancel", str(burst_id)], check=False)


def test_a_cancelled_parent_leaves_no_burst_job(devcluster: DevCluster, tmp_path: Path) -> None:
    job = start_controller_job(
        devcluster, tmp_path, nodes=1, gpus_per_node=4,
        burst=burst_options(devcluster, controller_unreachable_grace_s=10, signal_lead_s=None))
    try:
        with job.client() as c:
            c.scale(6)
        try:
            [(burst_id, _state)] = wait_for(lambda: [b for b in burst_jobs_of(job) if b[1] == "RUNNING"], 60,
                                            "a running burst job")
        except AssertionError as exc:
            queue = run_command(["squeue", "-o", "%i %P %j %T %N %r"]).stdout
            raise AssertionError(f"{exc}; the queue:\n{queue}; status: {job.status().get('burst')}") from None
    finally:
        stop_controller_job(job)  # scancel of the parent: its controller is gone with it
    wait_for(lambda: not burst_jobs_of(job), 60, f"burst job {burst_id} to end itself")


def test_stop_cancels_the_parents_running_and_pending_burst_jobs(devcluster: DevCluster, tmp_path: Path) -> None:
    """``slurm-elastic stop`` leaves no burst job, running or pending, well before their own
    unreachable-controller grace (300 s) could end them."""
    job = start_controller_job(
        devcluster, tmp_path, nodes=1, gpus_per_node=4,
        burst=burst_options(devcluster, max_jobs=2, controller_unreachable_grace_s=300, signal_lead_s=None))
    try:
        with job.client() as c:
            c.scale(10)  # 4 in the allocation, 4 in a burst job on node2, 2 in one that cannot start
        wait_for(lambda: sorted(s for _, s in burst_jobs_of(job)) == ["PENDING", "RUNNING"], 60,
                 "one running and one pending burst job")
        result = CliRunner().invoke(main, ["stop", str(job.job_id), "--drain-timeout-s", "60"])
        assert result.exit_code == 0, result.output
        wait_for(lambda: not burst_jobs_of(job), 30, "no burst job left")
    finally:
        stop_controller_job(job)
        for burst_id, _state in burst_jobs_of(job):
            run_command(["scancel", str(burst_id)], check=False)


@pytest.mark.parametrize("parent", [{"agent": {"enabled": True, "source": "inject", "interval_s": 0.5},
                                     "health": {"agent_silence_s": 3.0}}], indirect=True)
def test_with_node_agents_on_a_burst_jobs_gpus_take_workers_once_its_agent_reports(parent: ControllerJob) -> None:
    """Agents are on by default: the burst node's agent must be heard (its reports were refused as
    "not part of job"), the autoscaler must not give the burst job back meanwhile, and once the job
    is given back its node is not listed as of unknown health."""
    with parent.client() as c:
        c.scale(6)
    status = parent.active(6, timeout_s=60)
    [(burst_id, state)] = burst_jobs_of(parent)
    assert state == "RUNNING" and sum(1 for w in status["workers"] if w["job_id"] == burst_id) == 2
    assert status["unknown_health_nodes"] == []
    with parent.client() as c:
        c.resume()  # the autoscaler decides again; nothing measured yet: it holds
    time.sleep(3.0)
    assert parent.active(6, timeout_s=10)["target_workers"] == 6 and burst_jobs_of(parent) == [(burst_id, "RUNNING")]
    with parent.client() as c:
        c.scale(2)
    parent.active(2, timeout_s=60)
    wait_for(lambda: not burst_jobs_of(parent), 60, "the burst job to be given back")
    time.sleep(4.0)  # past agent_silence_s: a node still counted would read "health unknown" now
    assert parent.status()["unknown_health_nodes"] == []


def test_a_requeued_burst_job_waits_as_itself_and_its_workers_come_back_when_it_runs_again(
        devcluster: DevCluster, tmp_path: Path) -> None:
    """``scontrol requeue`` of a burst job with 2 workers in it (room for a second burst job): its
    workers are gone, the job is counted requeued (not lost, not cancelled) and waits in the queue
    as the one burst job (no replacement); once it runs again, 2 workers go there anew. Before, it
    was counted lost, a replacement was submitted while it completed, and it was then cancelled."""
    job = start_controller_job(
        devcluster, tmp_path, nodes=1, gpus_per_node=4, sbatch_options=("--nodelist=node1",),
        burst=burst_options(devcluster, max_jobs=2))
    try:
        with job.client() as c:
            c.scale(6)
        job.active(6, timeout_s=60)
        [(burst_id, _state)] = burst_jobs_of(job)
        run_command(["scontrol", "requeue", str(burst_id)])
        # its steps end first (COMPLETING): under a loaded CI host that took over 30 s once
        wait_for(lambda: burst_jobs_of(job) == [(burst_id, "PENDING")], 90, "the requeued job pending again")
        for _ in range(10):  # Slurm holds it back ~2 minutes: it stays the one burst job
            time.sleep(1)
            assert burst_jobs_of(job) == [(burst_id, "PENDING")]
        burst = job.status()["burst"]
        assert (burst["submitted"], burst["requeued"], burst["lost"], burst["cancelled"]) == (1, 1, 0, 0), burst
        run_command(["scontrol", "update", f"JobId={burst_id}", "StartTime=now"])
        status = job.active(6, timeout_s=90)
        assert sum(w["job_id"] == burst_id for w in status["workers"] if w["state"] == "ACTIVE") == 2
        assert burst_jobs_of(job) == [(burst_id, "RUNNING")]
        burst = status["burst"]
        assert (burst["submitted"], burst["requeued"], burst["lost"], burst["cancelled"]) == (1, 1, 0, 0), burst
    finally:
        stop_controller_job(job)
        for left, _state in burst_jobs_of(job):
            run_command(["scancel", str(left)], check=False)
