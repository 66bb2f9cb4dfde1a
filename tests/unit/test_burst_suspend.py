"""A suspended burst job (``scontrol suspend``, ``PreemptMode=SUSPEND``): its workers' steps stand
stopped, not ended. They are SUSPENDED: not counted, not crashes, not cancelled (Slurm 22.05's
scancel of a suspended job's step blocks until it resumes), and they keep their admissions, so
the staleness bound holds whatever comes next. Resumed, they go on as they were (same step, same
admissions, no relaunch); their job ended instead, their admissions are released."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_elastic.controller.burst_jobs import BurstJobs, burst_policy
from slurm_elastic.controller.burst_manager import BurstManager
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.state_model import restore_state
from slurm_elastic.core.burst import (
    BurstJob,
    BurstPolicy,
    burst_phase,
    decide_burst,
    on_hold,
    run_outcomes,
)
from slurm_elastic.core.lifecycle import (
    Worker,
    WorkerState,
    begin_drain,
    commands_ended,
    commands_stopped,
    suspend,
    transition,
)
from slurm_elastic.core.reconcile import (
    Cancel,
    Launch,
    ObservedStep,
    Plan,
    ReconcileConfig,
    Resumed,
    reconcile,
)
from slurm_elastic.core.registration import registration_refusal
from slurm_elastic.core.staleness import AdmissionLeases, StalenessManager
from slurm_elastic.errors import TransitionError
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.slurm.parse import QueuedJob
from tests.unit.test_burst_comment import PARENT, FakeSlurm

S = WorkerState
CFG = ReconcileConfig(drain_timeout_s=30, heartbeat_grace_s=10, start_timeout_s=20, step_end_settle_s=5)
NONE: frozenset[tuple[str, int]] = frozenset()
BURST = 7
SUSPENDED_REASON = f"its burst job {BURST} is suspended (its step stopped); not counted against its GPU"


def pool() -> dict[str, Worker]:
    """0001 in the job's own allocation, 0002 (busy) in burst job 7."""
    return {"0001": Worker("0001", state=S.ACTIVE, step_id="1", node="n1", gpus=(0,)),
            "0002": Worker("0002", state=S.ACTIVE, step_id="4", node="n2", gpus=(0,), job_id=BURST, busy=True)}


def tick(workers: dict[str, Worker], now_s: float, *, listed: tuple[str, ...], desired: int = 2, slots: int = 2,
         stopped: frozenset[int] = frozenset(), alive: frozenset[int] | None = frozenset({BURST}),
         running: frozenset[int] = frozenset({BURST})) -> Plan:
    """One reconcile; ``listed``: the workers whose steps Slurm lists; ``running``: the burst jobs
    whose steps were listed (running ones); ``alive``: those Slurm lists running, suspended or completing."""
    for worker_id in listed:
        if workers[worker_id].has_step:
            workers[worker_id].last_heartbeat_s = now_s  # heart-beating while it runs
    observed = [ObservedStep(w, workers[w].step_id, workers[w].node, workers[w].job_id) for w in listed]
    return reconcile(workers, observed, desired, slots, (), NONE, CFG, now_s, 10, drain_first_jobs=running,
                     stopped_jobs=stopped, alive_jobs=alive)


def suspended_at_1(workers: dict[str, Worker]) -> Plan:
    return tick(workers, 1.0, listed=("0001",), stopped=frozenset({BURST}), running=frozenset(), slots=1)


def test_a_suspended_jobs_worker_stands_stopped_keeps_its_admissions_and_is_not_cancelled() -> None:
    workers = pool()
    plan = suspended_at_1(workers)
    stopped = workers["0002"]
    assert (stopped.state, stopped.suspended_from, stopped.step_id) == (S.SUSPENDED, "ACTIVE", "4")
    assert stopped.history[-1] == (1.0, "ACTIVE", "SUSPENDED", SUSPENDED_REASON)
    assert plan.crashes == [] and not [a for a in plan.actions if isinstance(a, Cancel)]
    assert commands_ended(workers.values(), ()) == [] and commands_stopped(workers.values()) == ["0002"]
    assert not stopped.counts_as_capacity and not stopped.has_step and stopped.keeps_step
    assert registration_refusal("0002", stopped, frozenset()) == ""  # its heartbeat on resume is answered
    for now_s in (100.0, 1000.0):  # suspended for long: it waits, nothing times out
        plan = tick(workers, now_s, listed=("0001",), stopped=frozenset({BURST}), running=frozenset(), slots=1)
        assert stopped.state is S.SUSPENDED and plan.actions == [] and plan.crashes == []


def test_a_replacement_is_launched_elsewhere_while_it_stands() -> None:
    workers = pool()
    plan = tick(workers, 1.0, listed=("0001",), stopped=frozenset({BURST}), running=frozenset(), slots=2)
    assert [a.worker_id for a in plan.actions if isinstance(a, Launch)] == ["0010"]  # its slot is not counted


def test_resumed_it_goes_on_as_it_was_with_its_step_and_clocks_moved_on() -> None:
    workers = pool()
    workers["0002"].last_heartbeat_s = 0.5
    suspended_at_1(workers)
    plan = tick(workers, 301.0, listed=("0001", "0002"))
    resumed = workers["0002"]
    assert plan.resumed == [Resumed("0002", BURST, 300.0)] and plan.actions == [] and plan.crashes == []
    assert (resumed.state, resumed.step_id, resumed.launches, resumed.busy) == (S.ACTIVE, "4", 0, True)  # not adopted anew
    assert resumed.history[-1] == (301.0, "SUSPENDED", "ACTIVE", f"its burst job {BURST} runs again: its step 4 goes on")
    assert resumed.last_heartbeat_s == 300.5  # 300 s stood still: not taken for hung
    assert tick(workers, 305.0, listed=("0001", "0002")).actions == []


def test_a_draining_or_starting_worker_comes_back_to_its_state_with_its_clock_moved_on() -> None:
    workers = pool()
    begin_drain(workers["0002"], 0.0, "scale-down")
    workers["0003"] = Worker("0003", state=S.STARTING, step_id="5", node="n2", job_id=BURST, launched_at_s=0.0)
    tick(workers, 10.0, listed=("0001",), stopped=frozenset({BURST}), running=frozenset(), desired=1, slots=1)
    assert workers["0002"].suspended_from == "DRAINING" and workers["0003"].suspended_from == "STARTING"
    plan = tick(workers, 110.0, listed=("0001", "0002", "0003"), desired=2, slots=3)
    assert (workers["0002"].state, workers["0002"].drain_started_s) == (S.DRAINING, 100.0)  # no drain timeout
    assert (workers["0003"].state, workers["0003"].launched_at_s) == (S.STARTING, 100.0)  # no start timeout
    assert len(plan.resumed) == 2 and not [a for a in plan.actions if isinstance(a, Cancel)]


def test_it_waits_while_its_job_completes_or_is_not_known_and_ends_when_the_job_is_gone() -> None:
    workers = pool()
    suspended_at_1(workers)
    tick(workers, 2.0, listed=("0001",), running=frozenset(), slots=1)  # COMPLETING (cancelled while suspended)
    tick(workers, 3.0, listed=("0001",), running=frozenset(), alive=None, slots=1)  # the listing failed
    assert workers["0002"].state is S.SUSPENDED and commands_ended(workers.values(), ()) == []
    plan = tick(workers, 4.0, listed=("0001",), running=frozenset(), alive=frozenset(), slots=1)  # gone
    assert workers["0002"].state is S.INACTIVE and plan.crashes == [] and workers["0002"].step_id == ""
    assert workers["0002"].history[-1][3] == f"its burst job {BURST} ended while suspended; not counted against its GPU"
    assert commands_ended(workers.values(), ()) == ["0002"]  # its admissions are released now


def test_its_job_running_again_without_its_step_ends_it_uncounted_after_the_settle_time() -> None:
    """Requeued while suspended, the job runs a new run: the old processes are gone. Not resumed
    (its log would say it goes on with its step), not a crash on its GPU; the settle time covers a
    job listing taken after a resume with a step listing taken before it."""
    workers = pool()
    suspended_at_1(workers)
    plan = tick(workers, 50.0, listed=("0001",))
    assert plan.resumed == [] and workers["0002"].state is S.SUSPENDED and workers["0002"].vanished_at_s == 50.0
    plan = tick(workers, 56.0, listed=("0001",))
    assert workers["0002"].state is S.INACTIVE and plan.crashes == [] and workers["0002"].step_id == ""
    assert workers["0002"].history[-1][3] == (f"its burst job {BURST} runs again without its step (requeued while "
                                              "suspended); not counted against its GPU")
    assert commands_ended(workers.values(), ()) == ["0002"]  # its admissions are released now


def test_a_step_listed_within_the_settle_time_is_resumed_as_it_was() -> None:
    workers = pool()
    suspended_at_1(workers)
    tick(workers, 50.0, listed=("0001",), slots=1)  # the job listed running, its steps not yet
    plan = tick(workers, 52.0, listed=("0001", "0002"))
    assert [r.worker_id for r in plan.resumed] == ["0002"] and workers["0002"].state is S.ACTIVE
    assert workers["0002"].vanished_at_s == 0.0 and workers["0002"].step_id == "4"


def test_a_placeholder_in_a_suspended_job_stands_suspended_and_comes_back_a_placeholder() -> None:
    """Ended and adopted anew on resume, its hold-only wrapper would be told to register and count
    as a worker that runs no command."""
    workers = pool()
    workers["0002"].placeholder = True
    suspended_at_1(workers)
    assert workers["0002"].state is S.SUSPENDED and workers["0002"].history[-1][3] == SUSPENDED_REASON
    plan = tick(workers, 20.0, listed=("0001", "0002"))
    assert [r.worker_id for r in plan.resumed] == ["0002"]
    assert workers["0002"].placeholder and workers["0002"].state is S.ACTIVE


def test_another_step_under_its_id_ends_it_and_is_adopted() -> None:
    workers = pool()
    suspended_at_1(workers)
    tick(workers, 20.0, listed=("0001",), running=frozenset())
    workers_steps = [ObservedStep("0001", "1", "n1", 0), ObservedStep("0002", "4", "n3", 9)]  # same step id, job 9
    plan = reconcile(workers, workers_steps, 2, 2, (), NONE, CFG, 21.0, 3)
    assert [h[3] for h in workers["0002"].history[-3:-1]] == ["another step of its id runs (9.4)",
                                                              "adopted running step 4"]
    assert workers["0002"].job_id == 9 and plan.resumed == []


def test_a_drain_does_not_take_a_worker_out_of_suspended() -> None:
    worker = Worker("0002", state=S.ACTIVE)
    suspend(worker, 1.0, "stopped")
    with pytest.raises(TransitionError, match="resume"):
        begin_drain(worker, 2.0, "scale-down")
    assert worker.state is S.SUSPENDED


def test_suspended_is_entered_and_left_only_through_suspend_and_resume() -> None:
    worker = Worker("0002", state=S.ACTIVE)
    with pytest.raises(TransitionError, match="suspend"):
        transition(worker, S.SUSPENDED, 1.0, "by hand")
    suspend(worker, 1.0, "stopped")
    with pytest.raises(TransitionError, match="resume"):
        transition(worker, S.ACTIVE, 2.0, "by hand")


def test_a_restarted_controller_finds_it_suspended_and_resumes_it(tmp_path: Path) -> None:
    workers = pool()
    suspended_at_1(workers)
    saved = json.loads(json.dumps({"workers": {w: r.to_json() for w, r in workers.items()}}))
    restored = restore_state(saved).workers
    assert restored["0002"].state is S.SUSPENDED and restored["0002"].suspended_from == "ACTIVE"
    plan = tick(restored, 500.0, listed=("0001", "0002"))
    assert restored["0002"].state is S.ACTIVE and [r.worker_id for r in plan.resumed] == ["0002"]
    broken = {**saved["workers"]["0002"], "suspended_from": ""}  # it could not know where it goes back to
    notes = restore_state({"workers": {"0002": broken}})
    assert "0002" not in notes.workers


def test_the_lease_of_a_stopped_worker_outlives_the_ttl_and_covers_its_submit_after_the_resume() -> None:
    """AReaL's bound, (max_staleness + 1 + version) * batch accepted or in flight, holds across the
    suspension: the stopped worker's 4 sequences stay running, and its submit after the resume is
    taken from its lease, not as unadmitted on top of what others were granted meanwhile."""
    manager = StalenessManager(batch_size=4, max_staleness=0, max_concurrent=100)
    leases = AdmissionLeases(manager, ttl_s=60.0)
    assert leases.grant("0002", 4, 0.0) == 4 and manager.capacity() == 0
    assert leases.hold(["0002"], 1.0) and not leases.hold(["0002"], 2.0)  # changed once: saved once
    for now_s in range(0, 600, 5):  # the controller's ticks while the job stands
        assert leases.expire(float(now_s)) == 0
        assert (manager.running, manager.capacity()) == (4, 0)
        assert leases.grant("0009", 4, float(now_s)) == 0  # nobody else is granted its room
    assert leases.accept("0002", 0, 600.0) == 0 and "0002" in leases.leases  # no TTL check while it stands
    assert leases.hold([], 600.0)  # resumed: a whole TTL from now
    assert leases.expire(655.0) == 0 and leases.accept("0002", 4, 655.0) == 4  # covered by its lease
    assert (manager.running, manager.accepted, manager.capacity()) == (0, 4, 0)


def test_a_stopped_workers_lease_is_released_when_its_job_ends() -> None:
    manager = StalenessManager(batch_size=4, max_staleness=0, max_concurrent=100)
    leases = AdmissionLeases(manager, ttl_s=60.0)
    leases.grant("0002", 4, 0.0)
    leases.hold(["0002"], 1.0)
    assert leases.release("0002") == 4 and leases.hold([], 500.0) and manager.running == 0


def test_the_queue_saves_which_workers_stand_so_a_restart_keeps_their_leases(tmp_path: Path) -> None:
    clock = [1000.0]
    config = QueueConfig(batch_size=4, capacity_seqs=100, max_staleness=0, max_concurrent=100, fsync="off",
                         admission_ttl_s=60)

    def make() -> RolloutQueue:
        return RolloutQueue(RolloutStore(tmp_path / "q.sqlite", fsync="off"), config, clock=lambda: clock[0])
    q = make()
    assert q.admit(4, "0002") == 4
    q.hold_leases(["0002"])
    clock[0] += 200.0  # suspended, past the TTL
    assert q.stats()["running_rollouts"] == 4
    q.store.close()
    clock[0] += 1000.0  # the controller is down for long: the open expires no stopped worker's lease
    again = make()
    assert again.stats()["running_rollouts"] == 4 and again.stats()["staleness_capacity"] == 0
    again.hold_leases([])  # its job resumed
    assert again.submit("g1", "0002", 4, 0, b'{"id": "g1"}')
    assert (again.staleness.running, again.staleness.accepted) == (0, 4)


def test_a_suspended_burst_job_is_not_over_and_is_lost_only_if_it_ends_unreleased() -> None:
    suspended = BurstJob(BURST, burst_phase("SUSPENDED"), 2, suspended=True, on_hold=on_hold("SUSPENDED", ""))
    running = BurstJob(BURST, "RUNNING", 2)
    runs = run_outcomes({BURST}, [suspended], frozenset())
    assert runs.lost == () and runs.requeued == () and BURST in runs.running
    assert run_outcomes(runs.running, [running], frozenset()).lost == ()  # resumed
    assert run_outcomes(runs.running, [], frozenset()).lost == (BURST,)  # cancelled by someone else
    assert run_outcomes(runs.running, [], frozenset({BURST})).lost == ()  # given back by the pool


def test_a_job_suspended_longer_than_the_admission_ttl_is_given_back_whatever_the_target() -> None:
    """Its workers' admissions are held while it stands suspended (no TTL runs for them); with
    max_jobs burst jobs out, nothing else would end the hold, and a staleness room they fill would
    stall every other worker (and the trainer, at a bound of 0) for as long as Slurm keeps it."""
    policy = BurstPolicy(max_jobs=1, worker_slots_per_job=2, submit_cooldown_s=0)
    suspended = BurstJob(BURST, "RUNNING", 2, suspended=True, on_hold=True)
    waiting = decide_burst(policy, target_workers=6, allocation_slots=2, jobs=[suspended], releasing=frozenset(),
                           last_submit_s=None, now_s=100.0)
    assert waiting.cancel == () and waiting.submit == 0  # max_jobs out: the suspended job is waited for
    given_back = decide_burst(policy, target_workers=6, allocation_slots=2, jobs=[suspended], releasing=frozenset(),
                              last_submit_s=None, now_s=700.0, suspended_too_long=frozenset({BURST}))
    assert given_back.cancel == (BURST,) and given_back.submit == 0 and "admission TTL" in given_back.reason


class SuspendingSlurm(FakeSlurm):
    """Lists its jobs SUSPENDED while ``suspended``; cancels them."""

    suspended = False

    def _listed(self, job_id: int) -> QueuedJob:
        return replace(super()._listed(job_id), state="SUSPENDED" if self.suspended else "RUNNING")

    def cancel_job(self, job_id: int) -> None:
        self.cancelled.append(job_id)


def test_the_manager_gives_back_a_job_suspended_for_the_admission_ttl(tmp_path: Path) -> None:
    config = parse_config({"burst": {"max_jobs": 1, "gpus_per_job": 2}, "queue": {"admission_ttl_s": 300}})
    slurm = SuspendingSlurm()
    slurm.cancelled = []
    made = BurstManager(BurstJobs(slurm, config, PARENT, tmp_path), burst_policy(config), 1,  # type: ignore[arg-type]
                        suspended_limit_s=300.0)

    def step(now_s: float) -> None:
        made.observe()
        made.step(target_workers=8, allocation_slots=4, workers_by_job={}, draining_by_job={}, now_s=now_s)

    step(0.0)
    [job] = list(slurm.jobs)
    slurm.suspended = True
    for now_s in (10.0, 200.0, 309.0):
        step(now_s)
    assert slurm.cancelled == [] and made.suspended == frozenset({job})
    step(310.0)
    assert slurm.cancelled == [job] and made.counters.cancelled == 1


def test_a_suspended_placeholder_gets_no_cancel_when_its_gpu_is_uncordoned() -> None:
    """Slurm 22.05's scancel of a suspended job's step blocks until it resumes, inside the tick."""
    workers = {"0003": Worker("0003", state=S.ACTIVE, step_id="5", node="n9", gpus=(0,), job_id=BURST,
                              placeholder=True)}
    cordoned = frozenset({("n9", 0)})
    reconcile(workers, [], 0, 0, (), cordoned, CFG, 10.0, 4, stopped_jobs=frozenset({BURST}),
              alive_jobs=frozenset({BURST}))
    assert workers["0003"].state is S.SUSPENDED
    plan = reconcile(workers, [], 0, 0, (), NONE, CFG, 20.0, 4, stopped_jobs=frozenset({BURST}),
                     alive_jobs=frozenset({BURST}))
    assert not [a for a in plan.actions if isinstance(a, Cancel)]


def test_a_vanished_stamp_from_before_the_suspension_does_not_cut_the_settle_time_short() -> None:
    """The steps listed after the jobs: a suspension in between stamps the step gone first."""
    workers = pool()
    tick(workers, 1.0, listed=("0001",), slots=1)  # its job still listed running, its step not: stamped
    assert workers["0002"].vanished_at_s == 1.0
    suspended_at_1(workers)
    tick(workers, 400.0, listed=("0001",), slots=1)  # resumed, its step not listed yet
    assert workers["0002"].state is S.SUSPENDED


@pytest.mark.parametrize("state", ["SUSPENDED", "STOPPED"])
def test_a_stopped_job_is_held_like_a_suspended_one(state: str) -> None:
    """``scancel --signal=STOP``: counted against max_jobs (no replacement past it), on hold, and
    given back at the admission TTL."""
    assert burst_phase(state) == "PENDING" and on_hold(state, "")
    policy = BurstPolicy(max_jobs=1, worker_slots_per_job=2, submit_cooldown_s=0)
    job = BurstJob(BURST, burst_phase(state), 2, suspended=True, on_hold=True)
    held = decide_burst(policy, target_workers=6, allocation_slots=2, jobs=[job], releasing=frozenset(),
                        last_submit_s=None, now_s=10.0)
    assert held.submit == 0 and held.cancel == ()
    overdue = decide_burst(policy, target_workers=6, allocation_slots=2, jobs=[job], releasing=frozenset(),
                           last_submit_s=None, now_s=700.0, suspended_too_long=frozenset({BURST}))
    assert overdue.cancel == (BURST,)


def test_the_time_suspended_is_counted_across_a_controller_restart(tmp_path: Path) -> None:
    """A controller that restarts more often than the TTL would otherwise never give the job back."""
    config = parse_config({"burst": {"max_jobs": 1, "gpus_per_job": 2}, "queue": {"admission_ttl_s": 300}})
    slurm = SuspendingSlurm()
    slurm.cancelled = []

    def manager() -> BurstManager:
        return BurstManager(BurstJobs(slurm, config, PARENT, tmp_path), burst_policy(config), 1,  # type: ignore[arg-type]
                            suspended_limit_s=300.0)

    def step(made: BurstManager, now_s: float) -> None:
        made.observe()
        made.step(target_workers=8, allocation_slots=4, workers_by_job={}, draining_by_job={}, now_s=now_s)

    made = manager()
    step(made, 0.0)
    slurm.suspended = True
    step(made, 10.0)
    step(made, 300.0)
    again = manager()
    memory = restore_state(json.loads(json.dumps({"burst": made.to_state()}))).burst
    assert memory is not None
    again.restore(memory)
    step(again, 309.0)
    assert slurm.cancelled == []
    step(again, 310.0)
    assert slurm.cancelled == list(slurm.jobs)
