"""Burst jobs on the real dev cluster: a step launched from inside a parent job into its burst job,
signalled and listed like any worker step; preemption's SIGTERM; the burst job ending itself."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.controller.burst_jobs import BurstJobs, burst_policy
from slurm_elastic.controller.burst_manager import BurstManager
from slurm_elastic.controller.config import parse_config
from slurm_elastic.core.burst import burst_job_comment
from slurm_elastic.devcluster.cluster import DevCluster
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import wait_for

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def comment_of(job_id: int) -> str:
    return run_command(["squeue", "-h", "-j", str(job_id), "--format=%k"]).stdout.strip()


def gone(job_id: int) -> bool:
    return not run_command(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip()


def test_a_step_launched_from_the_parent_runs_in_the_burst_job_and_preemption_sends_it_sigterm(
        devcluster: DevCluster, slurm: SlurmCli, tmp_path: Path) -> None:
    script = tmp_path / "parent.sh"
    script.write_text(f"#!/bin/bash\nexport PYTHONPATH={REPO}\n"
                      f"exec {sys.executable} -m tests.cluster.burst_parent {tmp_path} {devcluster.spec.preempt_partition}\n")
    parent = int(run_command(["sbatch", "--parsable", "--nodes=1", "--nodelist=node1", "--exclusive", "--gres=gpu:4",
                              "--mem=0", "--job-name=se-burst-parent", f"--output={tmp_path}/parent.out",
                              str(script)]).stdout.split(";")[0])
    burst = 0
    try:
        burst = wait_for(lambda: json.loads((tmp_path / "parent.json").read_text())["burst"]
                         if (tmp_path / "parent.json").exists() else 0, 60, "the parent to submit a burst job")
        probe = tmp_path / "probe.jsonl"
        env = wait_for(lambda: next((r["env"] for r in records(probe) if "env" in r), None), 30, "the probe step")
        # the step runs in the burst job, on its node, and sees that job's variables, not the parent's
        assert env["SLURM_JOB_ID"] == str(burst) and env["SLURMD_NODENAME"] == "node2"
        assert env["SLURM_JOB_NODELIST"] == "node2" and env.get("SLURM_JOB_GPUS") != "0,1,2,3"
        assert env["SLURM_STEP_GPUS"] in {"0", "1"}
        listed = BurstJobs(slurm, parse_config({}), parent, tmp_path / "state").listed()
        assert [(j.job_id, j.state, j.nodes, j.gpus_per_node) for j in listed] == [(burst, "RUNNING", ("node2",), 2)]
        step = next(s for s in slurm.list_steps(burst) if s.name == "se-w-burst")
        assert step.tres_per_node.endswith("gpu:1")
        slurm.signal_step(burst, step.step_id, "USR1")  # the drain, exactly as for a step of the parent
        wait_for(lambda: any(r.get("signal") == "SIGUSR1" for r in records(probe)), 15, "USR1 at the probe")
        # a job of a higher partition tier wants node2's GPUs: the burst job is preempted with a grace time
        urgent = run_command(["sbatch", "--parsable", f"--partition={devcluster.spec.urgent_partition}",
                              "--nodelist=node2", "--gres=gpu:4", "--output=/dev/null", "--job-name=se-urgent",
                              "--wrap", "sleep 30"]).stdout.strip().split(";")[0]
        try:
            wait_for(lambda: any(r.get("signal") == "SIGTERM" for r in records(probe)), 20, "SIGTERM at the probe")
        finally:
            run_command(["scancel", urgent], check=False)
    finally:
        run_command(["scancel", str(parent)], check=False)
        if burst:
            run_command(["scancel", str(burst)], check=False)
            wait_for(lambda: gone(burst), 30, f"burst job {burst} to end")


def test_a_burst_job_ends_itself_when_the_controller_does_not_answer(devcluster: DevCluster, slurm: SlurmCli,
                                                                       tmp_path: Path) -> None:
    config = parse_config({"burst": {"max_jobs": 1, "gpus_per_job": 1, "controller_unreachable_grace_s": 2}})
    jobs = BurstJobs(slurm, config, 999999, tmp_path / "state")  # no controller published there
    burst = jobs.submit()
    try:
        wait_for(lambda: any(j.job_id == burst for j in jobs.listed()), 10, "the burst job to be listed")
        wait_for(lambda: gone(burst), 60, "the burst job to end by itself")
        out = (tmp_path / "state" / "burst" / f"burst-{burst}.out").read_text()
        assert "controller unreachable" in out
    finally:
        jobs.cancel(burst)
    jobs.cancel(burst)  # an ended job: no error


def test_a_burst_job_ends_at_its_first_probe_once_its_parent_job_is_over(devcluster: DevCluster, slurm: SlurmCli,
                                                                          tmp_path: Path) -> None:
    """The controller silent and Slurm listing the parent no more: the grace (here 600 s) is not
    waited; while the parent runs it is."""
    config = parse_config({"burst": {"max_jobs": 1, "gpus_per_job": 1, "controller_unreachable_grace_s": 600}})
    parent = int(run_command(["sbatch", "--parsable", "--job-name=burst-parent", "--output=/dev/null", "--mem=64",
                              "--wrap", "sleep 900"]).stdout.strip().split(";")[0])
    jobs = BurstJobs(slurm, config, parent, tmp_path / "state")  # no controller published there
    burst = jobs.submit()
    try:
        wait_for(lambda: [j.state for j in jobs.listed() if j.job_id == burst] == ["RUNNING"], 30,
                 "the burst job to run")
        time.sleep(12)  # a probe or two while the parent runs: the grace holds it
        assert not gone(burst)
        slurm.cancel_job(parent)
        wait_for(lambda: gone(burst), 40, "the burst job to end at its next probe")
        out = (tmp_path / "state" / "burst" / f"burst-{burst}.out").read_text()
        assert f"controller unreachable and parent job {parent} is" in out, out
    finally:
        jobs.cancel(burst)
        slurm.cancel_job(parent)


def test_the_manager_submits_releases_through_slurm_is_adopted_after_a_restart_and_cancelled(
        devcluster: DevCluster, slurm: SlurmCli, tmp_path: Path) -> None:
    config = parse_config({"burst": {"max_jobs": 2, "gpus_per_job": 2, "submit_cooldown_s": 0,
                                     "partition": devcluster.spec.preempt_partition,
                                     "controller_unreachable_grace_s": 600}})
    # a parent Slurm lists as running: with none, its burst jobs would end at their first probe
    parent = int(run_command(["sbatch", "--parsable", "--job-name=burst-parent", "--output=/dev/null", "--mem=64",
                              "--wrap", "sleep 900"]).stdout.strip().split(";")[0])

    def manager() -> BurstManager:
        made = BurstManager(BurstJobs(slurm, config, parent, tmp_path / "state"), burst_policy(config), 1)
        made.observe()
        return made
    first = manager()
    try:
        assert first.step(target_workers=7, allocation_slots=4, workers_by_job={}, draining_by_job={}, now_s=0).submit == 2
        wait_for(lambda: [j.state for j in manager().listed] == ["RUNNING", "RUNNING"], 30, "both burst jobs to run")
        restarted = manager()  # a new controller: adopts both, submits nothing
        assert restarted.step(target_workers=7, allocation_slots=4, workers_by_job={}, draining_by_job={},
                              now_s=1).submit == 0
        gpus = restarted.running_gpus()
        assert sorted(gpus) == sorted(j.job_id for j in restarted.listed)
        assert all(sum(len(g) for g in by_node.values()) == 2 for by_node in gpus.values())
        a, b = sorted(gpus)
        decision = restarted.step(target_workers=6, allocation_slots=4, workers_by_job={a: 2, b: 1},
                                  draining_by_job={}, now_s=2)
        assert decision.release == (b,) and decision.cancel == ()
        for job_id in (a, b):  # an operator's note over both comments: each is set back, b's mark with it
            run_command(["scontrol", "update", f"JobId={job_id}", "Comment=my own note"])
        restarted.observe()
        assert sorted(j.job_id for j in restarted.listed) == [a, b] and restarted.releasing == {b}
        assert comment_of(a) == burst_job_comment(parent) and comment_of(b) == burst_job_comment(parent, True)
        run_command(["scontrol", "update", f"JobId={a}", "JobName=my own job"])  # a rename: found by id, named back
        restarted.observe()
        assert sorted(j.job_id for j in restarted.listed) == [a, b]
        assert run_command(["squeue", "-h", "-j", str(a), "-o", "%j"]).stdout.strip() == f"elastic-burst-{parent}"
        run_command(["scontrol", "update", f"JobId={a}", "JobName=my own job", "Comment=my own note"])
        started_after = manager()  # a controller started after both changes finds a by its script
        assert sorted(j.job_id for j in started_after.listed) == [a, b]
        assert comment_of(a) == burst_job_comment(parent)
        assert run_command(["squeue", "-h", "-j", str(a), "-o", "%j"]).stdout.strip() == f"elastic-burst-{parent}"
        again = manager()  # the mark is in Slurm: another restart knows b is being emptied
        assert again.releasing == {b}
        assert [r["state"] for r in again.status_rows({a: 2})] == ["RUNNING", "RELEASING"]
        assert again.step(target_workers=6, allocation_slots=4, workers_by_job={a: 2}, draining_by_job={},
                          now_s=3).cancel == (b,)
        wait_for(lambda: gone(b), 30, f"burst job {b} to end")
        assert slurm.cancel_burst_jobs(parent) == [a]  # what `slurm-elastic stop` and the epilog run
        wait_for(lambda: gone(a), 30, f"burst job {a} to end")
    finally:
        slurm.cancel_burst_jobs(parent)
        slurm.cancel_job(parent)


def test_a_requeued_burst_job_is_the_same_job_pending_again_and_is_used_again_when_it_runs(
        devcluster: DevCluster, slurm: SlurmCli, tmp_path: Path) -> None:
    """``scontrol requeue``: the job goes COMPLETING, then PENDING (``BeginTime``) under the same id.
    It is counted requeued (not lost, not cancelled), no replacement is submitted while it waits,
    and when it runs again its GPUs are read anew. ``scontrol requeuehold`` of a job not needed any
    more: it is cancelled as any held pending job. Before, the requeued job was counted lost, its
    GPUs were those of its first run, and a held requeue was taken for capacity."""
    config = parse_config({"burst": {"max_jobs": 2, "gpus_per_job": 2, "submit_cooldown_s": 0,
                                     "partition": devcluster.spec.preempt_partition,
                                     "controller_unreachable_grace_s": 600}})
    parent = int(run_command(["sbatch", "--parsable", "--job-name=burst-parent", "--output=/dev/null", "--mem=64",
                              "--wrap", "sleep 900"]).stdout.strip().split(";")[0])
    made = BurstManager(BurstJobs(slurm, config, parent, tmp_path / "state"), burst_policy(config), 1)
    states: list[str] = []
    submitted: list[int] = []

    def tick(target: int = 6) -> list[str]:
        assert made.observe()
        submitted.append(made.step(target_workers=target, allocation_slots=4, workers_by_job={},
                                   draining_by_job={}, now_s=time.monotonic()).submit)
        listed = [j.state for j in made.listed]
        if listed and (not states or states[-1] != listed[0]):
            states.append(listed[0])
        return listed
    try:
        tick()
        tick()
        [job] = [j.job_id for j in made.listed]
        wait_for(lambda: tick() == ["RUNNING"], 30, "the burst job to run")
        first_gpus = made.running_gpus()[job]
        assert sum(len(g) for g in first_gpus.values()) == 2
        submitted.clear()
        run_command(["scontrol", "requeue", str(job)])
        wait_for(lambda: tick() == ["PENDING"], 30, "the requeued job to be pending again")
        for _ in range(6):  # it waits (Slurm's requeue delay): no replacement
            assert tick() == ["PENDING"]
            time.sleep(0.5)
        c = made.counters
        assert (c.submitted, c.requeued, c.lost, c.cancelled) == (1, 1, 0, 0), c
        assert sum(submitted) == 0 and [j.job_id for j in made.listed] == [job] and made.running_gpus() == {}
        assert made.listed[0].reason == "BeginTime" and made.releasing == frozenset()
        run_command(["scontrol", "update", f"JobId={job}", "StartTime=now"])  # no need to wait Slurm's delay
        wait_for(lambda: tick() == ["RUNNING"], 60, "the requeued job to run again")
        again = made.running_gpus()[job]
        assert sum(len(g) for g in again.values()) == 2 and made.releasing == frozenset()
        assert made.last_decision.release == () and made.last_decision.cancel == ()
        assert (c.submitted, c.requeued, c.lost, c.cancelled) == (1, 1, 0, 0), c
        run_command(["scontrol", "requeuehold", str(job)])  # held: not waited for, as any held burst job
        wait_for(lambda: made.jobs_on_hold == 1 if tick() == ["PENDING"] else False, 30, "the job held in the queue")
        assert made.listed[0].reason == "job requeued in held state" and (c.requeued, c.lost) == (2, 0)
        wait_for(lambda: len(tick()) == 2, 10, "a second burst job beside the held one")
        assert made.last_decision.cancel == (job,)  # the other covers the target: the held one is not waited for
        wait_for(lambda: gone(job), 30, f"burst job {job} to end")
        assert (c.submitted, c.requeued, c.lost, c.cancelled) == (2, 2, 0, 1), c
        assert [s for s in states if s != "COMPLETING"][:4] == ["PENDING", "RUNNING", "PENDING", "RUNNING"], states
    finally:
        slurm.cancel_burst_jobs(parent)
        slurm.cancel_job(parent)
