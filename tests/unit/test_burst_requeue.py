"""A running burst job that Slurm requeues (``scontrol requeue``/``requeuehold``): the same job id
goes COMPLETING, then PENDING again. It is counted requeued, not lost and not cancelled, stays a
pending burst job (no replacement while it waits), and when it runs again it is used as a new
burst job (its GPUs read anew, GPU-seconds counted again). Slurm's states are those the dev
cluster showed (tests/cluster/test_burst_jobs.py checks them live)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.controller import burst_jobs
from slurm_elastic.controller.burst_manager import BurstManager
from slurm_elastic.slurm.parse import QueuedJob
from tests.unit.test_burst_comment import FakeSlurm
from tests.unit.test_burst_memory import new_manager, restarted


class RequeueSlurm(FakeSlurm):
    """A FakeSlurm whose jobs have a state, a pending reason and a node; scancel ends a job."""

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[int, tuple[str, str, str]] = {}
        self.cancelled: list[int] = []

    def _listed(self, job_id: int) -> QueuedJob:
        name, comment = self.jobs[job_id]
        state, reason, node = self.states.get(job_id, ("RUNNING", "", "node2"))
        return QueuedJob(job_id, state, (node,) if node else (), 2, reason, "", 1, "p", name, comment,
                         self.commands.get(job_id, ""))

    def cancel_job(self, job_id: int) -> None:
        self.cancelled.append(job_id)
        self.jobs.pop(job_id, None)

    def set(self, job_id: int, state: str, reason: str = "", node: str = "") -> None:
        self.states[job_id] = (state, reason, node)


def tick(made: BurstManager, target: int, workers: dict[int, int], now_s: float,
         ending: frozenset[int] = frozenset()) -> None:
    made.observe()
    made.step(target_workers=target, allocation_slots=4, workers_by_job=workers, draining_by_job={}, now_s=now_s,
              ending_jobs=ending)


def running_job(slurm: RequeueSlurm, tmp_path: Path) -> tuple[BurstManager, int]:
    made = new_manager(slurm, tmp_path)  # max_jobs 2, 2 slots a job, cooldown 60 s
    tick(made, 6, {}, now_s=0)
    [job] = list(slurm.jobs)
    tick(made, 6, {job: 2}, now_s=10)
    return made, job


def test_a_requeued_job_is_counted_requeued_not_lost_nor_cancelled_and_no_replacement_is_submitted(
        tmp_path: Path) -> None:
    slurm = RequeueSlurm()
    made, job = running_job(slurm, tmp_path)
    slurm.set(job, "COMPLETING", node="node2")  # scontrol requeue: its steps get SIGTERM, they report the drain
    tick(made, 6, {}, now_s=100, ending=frozenset({job}))
    assert made.last_decision.submit == 0 and slurm.cancelled == []  # completing: not known yet whether it ends
    slurm.set(job, "PENDING", "BeginTime")
    for t in (110, 120, 200, 300):  # pending for a while (Slurm's requeue delay): capacity asked for
        tick(made, 6, {}, now_s=t, ending=frozenset({job}) if t < 200 else frozenset())
        assert len(slurm.jobs) == 1 and slurm.cancelled == [], made.last_decision
    c = made.counters
    assert (c.submitted, c.requeued, c.lost, c.cancelled) == (1, 1, 0, 0)
    assert made.releasing == frozenset() and not slurm.jobs[job][1].endswith("released")  # the ending mark taken back
    assert made.to_state()["signalled"] == [] and made.to_state()["ending"] == []


def test_a_requeued_job_runs_again_as_a_new_burst_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    nodes = {"node2": (0, 1)}

    def gpus_by_node(job_id: int) -> dict[str, tuple[int, ...]]:
        reads.append(job_id)
        return dict(nodes)
    monkeypatch.setattr(burst_jobs, "job_gpus_by_node", gpus_by_node)
    slurm = RequeueSlurm()
    made, job = running_job(slurm, tmp_path)
    assert made.running_gpus() == {job: {"node2": (0, 1)}}
    held = made.counters.gpu_s_held
    slurm.set(job, "PENDING", "BeginTime")
    tick(made, 6, {}, now_s=20, ending=frozenset({job}))
    tick(made, 6, {}, now_s=200)
    assert made.running_gpus() == {} and made.counters.gpu_s_held == held  # pending: holds nothing
    nodes.clear()
    nodes["node1"] = (2, 3)
    slurm.set(job, "RUNNING", node="node1")
    tick(made, 6, {}, now_s=210)
    assert made.running_gpus() == {job: {"node1": (2, 3)}} and reads == [job, job]  # read anew
    assert made.releasing == frozenset() and made.last_decision.release == () and made.last_decision.cancel == ()
    tick(made, 6, {job: 2}, now_s=220)
    assert made.counters.gpu_s_held == held + 2 * 10 + 2 * 10  # counted again from its new start
    slurm.set(job, "TIMEOUT")  # this run ends unreleased: lost, once
    tick(made, 6, {}, now_s=230)
    assert (made.counters.requeued, made.counters.lost, made.counters.cancelled) == (1, 1, 0)


def test_a_job_requeued_in_held_state_waits_as_a_hold_and_is_cancelled_when_not_needed(tmp_path: Path) -> None:
    slurm = RequeueSlurm()
    made, job = running_job(slurm, tmp_path)
    slurm.set(job, "PENDING", "job requeued in held state")  # scontrol requeuehold
    tick(made, 6, {}, now_s=20, ending=frozenset({job}))
    assert made.jobs_on_hold == 1 and made.counters.requeued == 1 and slurm.cancelled == []
    tick(made, 4, {}, now_s=30)  # not needed any more: given back as any held pending job
    assert slurm.cancelled == [job] and (made.counters.cancelled, made.counters.lost) == (1, 0)


def test_a_signalled_job_that_ends_is_lost_once_also_across_a_restart(tmp_path: Path) -> None:
    slurm = RequeueSlurm()
    made, job = running_job(slurm, tmp_path)
    tick(made, 6, {}, now_s=20, ending=frozenset({job}))  # preempted: its workers drained, it is empty
    assert made.counters.lost == 0 and slurm.cancelled == [job]  # given back at once; lost once it has ended
    again = restarted(made, slurm, tmp_path)  # a restart before Slurm lists it no more
    tick(again, 6, {}, now_s=30)
    tick(again, 6, {}, now_s=40)
    # counted lost, not cancelled as well: a live probe's `scancel --signal=TERM B` read "lost 2  cancelled 2" for
    # 5 jobs submitted, 2 of them still running (B in both counts)
    assert (again.counters.lost, again.counters.cancelled, again.counters.requeued) == (1, 0, 0)


def test_a_completing_job_this_controller_gave_back_does_not_hold_back_a_new_one(tmp_path: Path) -> None:
    """A job the pool cancelled is never requeued: while Slurm still lists it COMPLETING (its
    epilog, KillWait), a target that rises again gets a new burst job at once."""
    slurm = RequeueSlurm()
    made, job = running_job(slurm, tmp_path)
    listed = slurm.jobs[job]
    tick(made, 4, {}, now_s=100)  # not needed any more: empty, so given back at once
    assert slurm.cancelled == [job]
    slurm.jobs[job] = listed  # still listed, completing
    slurm.set(job, "COMPLETING", node="node2")
    tick(made, 6, {}, now_s=200)
    assert made.last_decision.submit == 1, made.last_decision.reason
    assert (made.counters.lost, made.counters.requeued) == (0, 0)


def test_a_job_stuck_completing_holds_back_a_new_one_only_for_a_while(tmp_path: Path) -> None:
    """A job that ends unreleased may be requeued, so a completing one is waited for; one stuck
    completing (a node that cannot kill its steps) is taken as ended after COMPLETING_WAIT_S."""
    from slurm_elastic.core.burst import COMPLETING_WAIT_S

    slurm = RequeueSlurm()
    made, job = running_job(slurm, tmp_path)
    slurm.set(job, "COMPLETING", node="node2")
    tick(made, 6, {}, now_s=100)
    assert made.last_decision.submit == 0 and "completing" in made.last_decision.reason
    tick(made, 6, {}, now_s=100 + COMPLETING_WAIT_S - 1)
    assert made.last_decision.submit == 0
    tick(made, 6, {}, now_s=100 + COMPLETING_WAIT_S)
    assert made.last_decision.submit == 1, made.last_decision.reason


def pending_job(slurm: RequeueSlurm, tmp_path: Path) -> tuple[BurstManager, int]:
    made = new_manager(slurm, tmp_path)
    tick(made, 6, {}, now_s=0)
    [job] = list(slurm.jobs)
    slurm.set(job, "PENDING", "Resources")
    tick(made, 6, {}, now_s=10)
    return made, job


@pytest.mark.parametrize("listed_ended", [True, False])
def test_a_pending_job_cancelled_from_outside_is_counted_lost_once(tmp_path: Path, listed_ended: bool) -> None:
    """An operator's ``scancel`` of a pending burst job: it never ran, and it was not given back by
    the pool. Before, it was in no counter (submitted 2 = cancelled 0 + lost 0 + 1 pending)."""
    slurm = RequeueSlurm()
    made, job = pending_job(slurm, tmp_path)
    if listed_ended:
        slurm.set(job, "CANCELLED")  # listed ended for a while (MinJobAge), then no more
        tick(made, 6, {}, now_s=20)
    slurm.jobs.pop(job)
    tick(made, 6, {}, now_s=30)
    tick(made, 6, {}, now_s=40)
    assert (made.counters.lost, made.counters.cancelled, made.counters.requeued) == (1, 0, 0)


def test_a_pending_job_the_pool_cancels_is_cancelled_not_lost(tmp_path: Path) -> None:
    slurm = RequeueSlurm()
    made, job = pending_job(slurm, tmp_path)
    tick(made, 2, {}, now_s=20)  # not needed any more
    assert slurm.cancelled == [job]
    tick(made, 2, {}, now_s=30)
    assert (made.counters.lost, made.counters.cancelled) == (0, 1)


def test_a_pending_job_cancelled_while_no_controller_ran_is_counted_lost_after_the_restart(tmp_path: Path) -> None:
    slurm = RequeueSlurm()
    made, job = pending_job(slurm, tmp_path)
    slurm.jobs.pop(job)
    again = restarted(made, slurm, tmp_path)
    tick(again, 6, {}, now_s=30)
    assert (again.counters.lost, again.counters.cancelled) == (1, 0)


def test_a_pending_job_that_starts_is_not_lost(tmp_path: Path) -> None:
    slurm = RequeueSlurm()
    made, job = pending_job(slurm, tmp_path)
    slurm.set(job, "RUNNING", node="node2")
    tick(made, 6, {job: 2}, now_s=20)
    tick(made, 6, {job: 2}, now_s=30)
    assert (made.counters.lost, made.counters.cancelled) == (0, 0)


@pytest.mark.parametrize("between", ["COMPLETING", "SUSPENDED"])
def test_a_pending_job_listed_completing_or_suspended_before_it_ends_is_counted_lost(
        tmp_path: Path, between: str) -> None:
    """A job that starts and fails at once may be listed COMPLETING (or SUSPENDED) between its
    PENDING and its end: still followed, and counted once it ends (before, in no count)."""
    slurm = RequeueSlurm()
    made, job = pending_job(slurm, tmp_path)
    slurm.set(job, between, node="node2")
    tick(made, 6, {}, now_s=20)
    slurm.jobs.pop(job)
    tick(made, 6, {}, now_s=30)
    assert (made.counters.lost, made.counters.cancelled) == (1, 0)
