"""Burst job decisions (core/burst.py): allocation first, pending is capacity, cooldown, max_jobs,
pending cancelled before running jobs are released, a released job cancelled once empty."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_elastic.core.burst import (
    BurstDecision,
    BurstJob,
    BurstPolicy,
    burst_first_drain_order,
    burst_job_comment,
    burst_job_name,
    burst_phase,
    decide_burst,
    is_released_comment,
    on_hold,
    parent_of_comment,
    run_outcomes,
)

POLICY = BurstPolicy(max_jobs=3, worker_slots_per_job=4, submit_cooldown_s=60.0)


def decide(target: int, jobs: tuple[BurstJob, ...] = (), *, slots: int = 4, releasing: frozenset[int] = frozenset(),
           last_submit_s: float | None = None, now_s: float = 1000.0, policy: BurstPolicy = POLICY) -> BurstDecision:
    return decide_burst(policy, target_workers=target, allocation_slots=slots, jobs=jobs, releasing=releasing,
                        last_submit_s=last_submit_s, now_s=now_s)


def running(job_id: int, workers: int = 4, draining: int = 0) -> BurstJob:
    return BurstJob(job_id, "RUNNING", 4, workers, draining)


def pending(job_id: int, expected_start_s: float | None = None) -> BurstJob:
    return BurstJob(job_id, "PENDING", 4, expected_start_s=expected_start_s)


def test_the_allocation_is_filled_first() -> None:
    assert decide(4).submit == 0
    assert decide(5).submit == 1
    assert decide(12).submit == 2


def test_off_by_default_submits_nothing_and_gives_back_what_it_holds() -> None:
    off = BurstPolicy(max_jobs=0, worker_slots_per_job=4, submit_cooldown_s=0)
    assert decide(100, policy=off).submit == 0
    assert decide(100, (pending(7), running(8, workers=0)), policy=off).cancel == (7, 8)


def test_a_pending_job_is_capacity_no_resubmission_while_it_waits() -> None:
    decision = decide(8, (pending(7),))
    assert decision.submit == 0 and decision.cancel == ()


def test_a_job_on_hold_is_no_capacity_takes_a_place_of_max_jobs_and_is_cancelled_once_not_needed() -> None:
    hold = BurstJob(7, "PENDING", 4, on_hold=True)
    assert decide(8, (hold,)).submit == 1  # the 4 slots beyond the allocation are not coming
    full = decide(16, (hold, running(8), running(9)))
    assert full.submit == 0 and "max_jobs (3) burst jobs exist, 1 of them pending on a hold" in full.reason
    covered = decide(8, (hold, running(8)))
    assert covered.cancel == (7,) and "1 of them pending on a hold" in covered.reason


def test_a_suspended_job_is_said_suspended_not_pending_on_a_hold() -> None:
    """A live probe: with one burst job suspended (`scontrol suspend`) and max_jobs reached, the
    decision read "1 of them pending on a hold (scontrol release, or scancel, lets the pool ask
    again)": the job was not pending, and `scontrol release` does nothing to a suspended job."""
    stood = BurstJob(7, "RUNNING", 4, on_hold=True, suspended=True)
    hold = BurstJob(6, "PENDING", 4, on_hold=True)
    full = decide(16, (stood, running(8), running(9)))
    assert full.submit == 0 and "1 of them suspended (scontrol resume" in full.reason
    assert "pending on a hold" not in full.reason
    both = decide(16, (hold, stood, running(8)))
    assert "1 of them pending on a hold (scontrol release" in both.reason and "1 of them suspended" in both.reason
    covered = decide(8, (stood, running(8)))
    assert covered.cancel == (7,) and "1 of them suspended" in covered.reason


@pytest.mark.parametrize(("state", "reason", "held"), [
    ("PENDING", "JobHeldUser", True), ("PENDING", "JobHeldAdmin", True), ("REQUEUE_HOLD", "", True),
    ("PENDING", "Resources", False), ("PENDING", "Priority", False), ("RUNNING", "JobHeldUser", False)])
def test_on_hold_reads_slurms_hold_reasons(state: str, reason: str, held: bool) -> None:
    assert on_hold(state, reason) is held


def test_cooldown_between_submissions() -> None:
    assert decide(12, (pending(7),), last_submit_s=990.0).submit == 0
    assert "cooldown" in decide(12, (pending(7),), last_submit_s=990.0).reason
    assert decide(12, (pending(7),), last_submit_s=900.0).submit == 1


def test_never_more_than_max_jobs() -> None:
    assert decide(100).submit == 3
    assert decide(100, (pending(1), running(2))).submit == 1
    assert decide(100, (pending(1), running(2), running(3))).submit == 0


def test_ended_jobs_hold_nothing_and_count_for_nothing() -> None:
    preempted = BurstJob(5, "ENDED", 4, workers=0)
    assert decide(8, (preempted,)).submit == 1


def test_scale_down_cancels_pending_jobs_first_latest_expected_start_first() -> None:
    jobs = (running(1), pending(2, expected_start_s=2000.0), pending(3, expected_start_s=5000.0))
    decision = decide(12, jobs)  # 8 needed beyond: one job too many
    assert decision.cancel == (3,) and decision.release == ()
    decision = decide(4, jobs)  # none needed: both pending ones, then the running one
    assert decision.cancel == (3, 2) and decision.release == (1,)


def test_a_running_job_is_released_whole_emptiest_first_and_cancelled_once_empty() -> None:
    jobs = (running(1, workers=4), running(2, workers=1))
    assert decide(8, jobs).release == (2,)
    assert decide(8, jobs).cancel == ()
    assert decide(8, jobs).submit == 0
    still_draining = (running(1), running(2, workers=0, draining=1))
    assert decide(8, still_draining, releasing=frozenset({2})).cancel == ()
    empty = (running(1), running(2, workers=0, draining=0))
    assert decide(8, empty, releasing=frozenset({2})).cancel == (2,)


def test_a_job_partly_needed_is_kept() -> None:
    assert decide(6, (running(1),)) == BurstDecision(reason=decide(6, (running(1),)).reason)


def test_a_released_job_does_not_count_for_more_than_it_holds() -> None:
    decision = decide(12, (running(1, workers=0, draining=2),), releasing=frozenset({1}))
    assert decision.keep == (1,) and decision.submit == 1


def test_a_job_released_for_good_is_never_taken_back_but_cancelled_once_empty_and_replaced() -> None:
    """An ending job, or one whose nodes Slurm drained, does not hold the pool's slots even when the
    target needs them: it is cancelled once empty, and another job is asked for."""
    needed = decide_burst(POLICY, target_workers=8, allocation_slots=4, jobs=(running(1, workers=0, draining=2),),
                          releasing=frozenset({1}), last_submit_s=None, now_s=1000.0, released_for_good=frozenset({1}))
    assert needed.keep == () and needed.cancel == () and needed.submit == 1
    empty = decide_burst(POLICY, target_workers=8, allocation_slots=4, jobs=(running(1, workers=0),),
                         releasing=frozenset({1}), last_submit_s=None, now_s=1000.0, released_for_good=frozenset({1}))
    assert empty.keep == () and empty.cancel == (1,) and empty.submit == 1


def test_lost_jobs_are_running_ones_that_ended_unreleased() -> None:
    after = (BurstJob(1, "ENDED", 4), running(2))
    assert run_outcomes({1, 2}, after, frozenset()).lost == (1,)
    assert run_outcomes({1, 2}, after, frozenset({1})).lost == ()
    assert run_outcomes({1, 2}, (running(2),), frozenset()) == run_outcomes({1, 2}, after, frozenset())  # unlisted


def completing(job_id: int) -> BurstJob:
    return BurstJob(job_id, "ENDED", 4, completing=True)


def test_a_running_job_pending_again_was_requeued_not_lost_and_a_completing_one_is_told_apart_later() -> None:
    first = run_outcomes({1, 2}, (completing(1), running(2), completing(3)), frozenset())
    assert first.lost == () and first.requeued == () and first.running == {1, 2}  # 3 never ran here: not undecided
    requeue = run_outcomes(first.running, (pending(1), running(2)), frozenset())
    assert requeue.requeued == (1,) and requeue.lost == () and requeue.running == {2}
    held = BurstJob(1, "PENDING", 4, on_hold=True)  # scontrol requeuehold
    assert run_outcomes({1}, (held,), frozenset({1})).requeued == (1,)  # given back or not: the same job again
    ended = run_outcomes(first.running, (BurstJob(1, "ENDED", 4), running(2)), frozenset())
    assert ended.lost == (1,) and ended.requeued == ()
    assert run_outcomes(requeue.running | {1}, (running(1), running(2)), frozenset()).running == {1, 2}  # runs again


def test_a_completing_job_counts_against_max_jobs_and_as_capacity_and_is_never_cancelled() -> None:
    """Whether it ends or is requeued shows at the next listing: no replacement before."""
    assert decide(8, (completing(7),)).submit == 0
    assert decide(8, (completing(7),), releasing=frozenset({7})).cancel == ()
    full = BurstPolicy(max_jobs=1, worker_slots_per_job=4, submit_cooldown_s=0)
    assert decide(8, (completing(7),), releasing=frozenset({7}), policy=full).submit == 0
    assert decide(4, (completing(7),)).cancel == () and decide(4, (completing(7),)).release == ()


def test_a_requeue_hold_is_a_hold() -> None:
    assert on_hold("PENDING", "job requeued in held state") and not on_hold("PENDING", "BeginTime")
    assert not on_hold("COMPLETING", "job requeued in held state")


def test_names_and_comments_tie_a_burst_job_to_its_parent() -> None:
    assert burst_job_name(42) == "elastic-burst-42"
    assert parent_of_comment(burst_job_comment(42)) == 42
    assert parent_of_comment("slurm-elastic:/some/state/dir") is None
    assert parent_of_comment("slurm-elastic burst parent=4x") is None
    assert parent_of_comment(burst_job_comment(42, released=True)) == 42
    assert is_released_comment(burst_job_comment(42, released=True)) and not is_released_comment(burst_job_comment(42))
    assert [burst_phase(s) for s in ("PENDING", "RUNNING", "COMPLETING", "PREEMPTED", "TIMEOUT")] == [
        "PENDING", "RUNNING", "ENDED", "ENDED", "ENDED"]


def test_drain_order_released_jobs_then_burst_then_the_allocation() -> None:
    workers = {"0001": 10, "0002": 11, "0003": 12, "0004": 10}
    assert burst_first_drain_order(workers, parent_job_id=10, releasing=frozenset({12})) == ["0003", "0002", "0001", "0004"]


job_lists = st.lists(
    st.tuples(st.sampled_from(["PENDING", "RUNNING", "ENDED"]), st.integers(0, 4), st.integers(0, 2),
              st.one_of(st.none(), st.floats(0, 1e5)), st.booleans()),
    max_size=6,
).map(lambda rows: tuple(BurstJob(i + 1, phase, 4, workers if phase == "RUNNING" else 0,  # type: ignore[arg-type]
                                  draining if phase == "RUNNING" else 0, start, hold and phase == "PENDING")
                             for i, (phase, workers, draining, start, hold) in enumerate(rows)))


@settings(max_examples=300, deadline=None)
@given(jobs=job_lists, target=st.integers(0, 40), slots=st.integers(0, 12),
       releasing_mask=st.lists(st.booleans(), min_size=6, max_size=6),
       last_submit_s=st.one_of(st.none(), st.floats(0, 1000)), max_jobs=st.integers(0, 5))
def test_invariants(jobs: tuple[BurstJob, ...], target: int, slots: int, releasing_mask: list[bool],
                    last_submit_s: float | None, max_jobs: int) -> None:
    policy = BurstPolicy(max_jobs=max_jobs, worker_slots_per_job=4, submit_cooldown_s=60.0)
    releasing = frozenset(j.job_id for j, r in zip(jobs, releasing_mask, strict=False) if r)
    d = decide_burst(policy, target_workers=target, allocation_slots=slots, jobs=jobs, releasing=releasing,
                     last_submit_s=last_submit_s, now_s=1000.0)
    by_id = {j.job_id: j for j in jobs}
    live = [j for j in jobs if j.phase != "ENDED"]
    assert not set(d.cancel) & set(d.release)
    assert len(set(d.cancel)) == len(d.cancel) and len(set(d.release)) == len(d.release)
    for job_id in d.cancel:  # never cancel a job with workers still in it
        job = by_id[job_id]
        assert job.phase == "PENDING" or job.workers + job.draining_workers == 0
    for job_id in d.release:
        assert by_id[job_id].phase == "RUNNING" and job_id not in releasing
    assert set(d.keep) <= releasing and not set(d.keep) & set(d.cancel)
    assert all(by_id[i].phase == "RUNNING" for i in d.keep)
    remaining = len(live) - len(d.cancel)
    assert remaining + d.submit <= max(max_jobs, remaining)  # never more than max_jobs
    beyond = max(0, target - slots) if max_jobs else 0
    held_after = sum(j.worker_slots for j in live if j.job_id not in d.cancel and j.job_id not in d.release
                     and (j.job_id not in releasing or j.job_id in d.keep) and not j.on_hold)
    gave_back_held = [i for i in (*d.cancel, *d.release) if i not in releasing]
    if gave_back_held:  # giving back never leaves less than what is needed
        assert held_after >= beyond and d.submit == 0
    for job_id in d.cancel:
        if job_id in releasing:  # a released job is cancelled only once empty, and only if not needed again
            job = by_id[job_id]
            assert job.phase == "PENDING" or job.workers + job.draining_workers == 0
    if d.submit:  # submitting only when what is held or asked for falls short
        assert held_after < beyond
        assert last_submit_s is None or 1000.0 - last_submit_s >= 60.0
    if d.keep:
        assert held_after - sum(by_id[i].worker_slots for i in d.keep) < beyond
    pending_kept = [j for j in live if j.phase == "PENDING" and j.job_id not in releasing and j.job_id not in d.cancel]
    if d.release:  # pending jobs are cancelled before a running job is released
        assert pending_kept == []


def test_a_released_job_still_running_is_taken_back_before_anything_is_submitted() -> None:
    decision = decide(8, (running(1, workers=0, draining=2),), releasing=frozenset({1}))
    assert decision.keep == (1,) and decision.submit == 0 and decision.cancel == ()


def test_a_suspended_job_is_not_over_not_requeued_and_is_not_capacity() -> None:
    """scontrol suspend (or a preemption by suspension) stops the job's steps: its run is not over
    (resumed, it goes on), it is no requeue, and it holds no slots the pool can use until someone
    resumes it (tests/unit/test_burst_suspend.py: lost only if it ends unreleased)."""
    suspended = BurstJob(7, burst_phase("SUSPENDED"), 2, suspended=True, on_hold=on_hold("SUSPENDED", ""))
    runs = run_outcomes({7}, [suspended], frozenset())
    assert runs.requeued == () and runs.lost == () and 7 in runs.running
    policy = BurstPolicy(max_jobs=3, worker_slots_per_job=2, submit_cooldown_s=0.0)
    missing = decide_burst(policy, target_workers=6, allocation_slots=4, jobs=[suspended], releasing=frozenset(),
                           last_submit_s=None, now_s=100.0)
    assert missing.submit == 1, missing.reason  # a replacement: nothing says when it is resumed
    covered = decide_burst(policy, target_workers=4, allocation_slots=4, jobs=[suspended], releasing=frozenset(),
                           last_submit_s=None, now_s=100.0)
    assert covered.cancel == (7,)  # the others cover the target: given back, as a held job is
