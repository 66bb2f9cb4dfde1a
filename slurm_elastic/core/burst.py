"""Burst jobs: extra Slurm jobs that lend the pool worker slots beyond the job's allocation (pure).

A burst job is a batch job that only holds GPUs; the controller launches worker steps into it
exactly as into its own allocation. :func:`decide_burst` says, from the target worker count, the
allocation's worker slots and the burst jobs Slurm lists, which jobs to submit, which to cancel
and which to release (drain their workers, then cancel the job). The rules:

- the allocation's slots are filled first; burst jobs hold only what the target needs beyond them;
- a pending job is capacity already asked for: no new submission while it waits, and no new
  submission within ``submit_cooldown_s`` of the last one; never more than ``max_jobs`` jobs;
- a pending job on hold (``scontrol hold``, a requeue hold) is not capacity: it counts towards
  ``max_jobs`` and is cancelled as soon as the target does not need more than the others hold;
- a job Slurm requeued (``scontrol requeue``) is the same job pending again: capacity asked for, not
  lost (:func:`run_outcomes`); a completing job (ended, or about to be requeued: a later listing
  tells) counts towards ``max_jobs``, nothing is submitted for its slots while it completes (up to
  ``COMPLETING_WAIT_S``, and not once this controller gave it back: :func:`as_judged`), and it is
  neither cancelled nor released; a suspended job's run is not over (its workers' steps stand
  stopped): it waits as a job on hold, and is lost only if it ends without being given back;
- on scale-down, pending jobs are cancelled first (latest expected start first), then whole
  running jobs are released, the emptiest first; a released job is cancelled once its workers are
  gone, and one whose workers are all gone already is cancelled at once (its GPUs go back).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

BurstPhase = Literal["PENDING", "RUNNING", "ENDED"]

SUSPENDED_STATES = frozenset({"SUSPENDED", "STOPPED"})  # its processes stand stopped (scontrol suspend, SIGSTOP)
_PENDING_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}) | SUSPENDED_STATES
_RUNNING_STATES = frozenset({"RUNNING"})
_ALIVE_STATES = frozenset({"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING"}) | SUSPENDED_STATES
_HOLD_REASONS = frozenset({"JobHeldUser", "JobHeldAdmin", "job requeued in held state"})  # squeue's %r
COMPLETING_WAIT_S = 300.0  # a job listed COMPLETING longer than this is taken as ended (a node stuck completing)
BURST_NAME_PREFIX = "elastic-burst-"
BURST_COMMENT_PREFIX = "slurm-elastic burst parent="


def burst_job_name(parent_job_id: int) -> str:
    """The Slurm job name of ``parent_job_id``'s burst jobs."""
    return f"{BURST_NAME_PREFIX}{int(parent_job_id)}"


RELEASED_MARK = " released"


def burst_job_comment(parent_job_id: int, released: bool = False) -> str:
    """The Slurm comment of ``parent_job_id``'s burst jobs (how they are told apart from look-alikes);
    a job being emptied says so (the mark lives in Slurm, so a restarted controller knows it)."""
    return f"{BURST_COMMENT_PREFIX}{int(parent_job_id)}{RELEASED_MARK if released else ''}"


def parent_of_comment(comment: str) -> int | None:
    """The parent job id a burst job's comment names, or None for any other comment."""
    if not comment.startswith(BURST_COMMENT_PREFIX):
        return None
    rest = comment.removeprefix(BURST_COMMENT_PREFIX).removesuffix(RELEASED_MARK).strip()
    return int(rest) if rest.isdigit() else None


def is_released_comment(comment: str) -> bool:
    return parent_of_comment(comment) is not None and comment.endswith(RELEASED_MARK)


def burst_phase(slurm_state: str) -> BurstPhase:
    """What a Slurm job state means for capacity: PENDING (asked for), RUNNING (held), ENDED (neither).

    A COMPLETING, preempted, timed-out or cancelled job holds nothing the pool can use."""
    if slurm_state in _RUNNING_STATES:
        return "RUNNING"
    if slurm_state in _PENDING_STATES:
        return "PENDING"
    return "ENDED"


def processes_may_run(slurm_state: str) -> bool:
    """Whether a job's processes may still run, or stand stopped: running, suspended, completing."""
    return slurm_state in _ALIVE_STATES


def on_hold(slurm_state: str, reason: str) -> bool:
    """Whether a job waits on someone, not on the cluster: a hold (a user's or an admin's, or a
    requeue's), released by someone, or a suspension (``scontrol suspend``, a preemption by
    suspension, or ``scancel --signal=STOP``), resumed by someone; its workers' steps stand stopped
    until then."""
    return slurm_state == "REQUEUE_HOLD" or slurm_state in SUSPENDED_STATES or (
        burst_phase(slurm_state) == "PENDING" and reason in _HOLD_REASONS)


@dataclass(frozen=True)
class BurstPolicy:
    """The ``[burst]`` limits the decision needs."""

    max_jobs: int
    worker_slots_per_job: int
    submit_cooldown_s: float

    def __post_init__(self) -> None:
        if self.max_jobs < 0 or self.worker_slots_per_job < 1 or self.submit_cooldown_s < 0:
            raise ValueError(f"invalid burst policy {self}")


@dataclass(frozen=True)
class BurstJob:
    """One burst job as Slurm lists it, with what the pool has in it."""

    job_id: int
    phase: BurstPhase
    worker_slots: int
    workers: int = 0  # live workers of the pool in it (starting or active), draining ones not counted
    draining_workers: int = 0
    expected_start_s: float | None = None  # Slurm's estimate for a pending job, if it has one
    on_hold: bool = False  # pending on a hold (:func:`on_hold`): asked for, but not coming by itself
    completing: bool = False  # listed COMPLETING: its run is over; it ends, or Slurm requeues it
    suspended: bool = False  # listed SUSPENDED: its run stopped, not over; on hold until resumed


@dataclass(frozen=True)
class BurstDecision:
    """What to do with burst jobs this tick, and why (one line for logs and status)."""

    submit: int = 0
    cancel: tuple[int, ...] = ()  # scancel now: pending jobs not needed, released jobs now empty
    release: tuple[int, ...] = ()  # running jobs to empty: drain their workers, place nothing new there
    keep: tuple[int, ...] = ()  # released jobs needed again: they hold slots once more
    reason: str = ""


def decide_burst(
    policy: BurstPolicy,
    *,
    target_workers: int,
    allocation_slots: int,
    jobs: Iterable[BurstJob],
    releasing: frozenset[int],
    last_submit_s: float | None,
    now_s: float,
    released_for_good: frozenset[int] = frozenset(),
    suspended_too_long: frozenset[int] = frozenset(),
) -> BurstDecision:
    """Burst jobs to submit, cancel and release so that allocation + burst slots cover the target.

    ``allocation_slots``: worker slots of the parent allocation the pool may use; ``releasing``:
    running jobs already being emptied (they count as capacity no more); ``released_for_good``: those
    of them never taken back (ending, or on nodes Slurm took out of use). ``suspended_too_long``:
    jobs suspended for longer than their workers' admissions may be held (the admission TTL): they
    are given back first, whatever the target (their held admissions keep the staleness room from
    every other worker), and the rest is decided at the next listing."""
    live = [j for j in jobs if j.phase != "ENDED" or j.completing]
    overdue = tuple(j.job_id for j in live if j.suspended and j.job_id in suspended_too_long)
    if overdue:
        return BurstDecision(cancel=overdue, reason=f"burst: giving back {len(overdue)} job(s) suspended longer than "
                                                    "the admission TTL: their workers' admissions held the staleness room")
    on_hold = [j.job_id for j in live if j.on_hold and j.job_id not in releasing]
    stood = sum(1 for j in live if j.on_hold and j.suspended and j.job_id not in releasing)
    waiting = (len(on_hold) - stood, stood)
    held = [j for j in live if j.job_id not in releasing and not j.on_hold and not j.completing]
    beyond = max(0, target_workers - max(0, allocation_slots)) if policy.max_jobs else 0
    capacity = sum(j.worker_slots for j in held)
    undecided = sum(j.worker_slots for j in live if j.completing)  # requeued (capacity again) or ended: told later
    keep: list[int] = []  # released jobs that still run are taken back before anything is submitted
    for job in sorted((j for j in live if j.job_id in releasing - released_for_good and j.phase == "RUNNING"),
                      key=lambda j: (-(j.workers + j.draining_workers), j.job_id)):
        if capacity >= beyond:
            break
        keep.append(job.job_id)
        capacity += job.worker_slots
    cancel = [j.job_id for j in live if j.job_id in releasing and j.job_id not in keep and not j.completing
              and (j.phase == "PENDING" or j.workers + j.draining_workers == 0)]
    if beyond > capacity + undecided:
        return _grow(policy, beyond - capacity - undecided, len(live) - len(cancel), last_submit_s, now_s,
                     tuple(cancel), tuple(keep), waiting)
    if beyond > capacity:
        return BurstDecision(cancel=tuple(cancel), keep=tuple(keep),
                             reason=f"burst: {beyond - capacity} slots missing beyond the allocation; waiting for "
                                    f"the completing burst job(s) to end or be requeued")
    cancel += on_hold  # the others cover the target: a job on hold is not waited for
    if keep:
        return BurstDecision(cancel=tuple(cancel), keep=tuple(keep),
                             reason=f"burst: {beyond} slots needed beyond the allocation: keeping {len(keep)} released job(s)")
    surplus = capacity - beyond
    release: list[int] = []
    pending = sorted((j for j in held if j.phase == "PENDING"),
                     key=lambda j: (-(j.expected_start_s if j.expected_start_s is not None else math.inf), -j.job_id))
    running = sorted((j for j in held if j.phase == "RUNNING"), key=lambda j: (j.workers, -j.job_id))
    for job in [*pending, *running]:
        if job.worker_slots > surplus:
            continue
        surplus -= job.worker_slots
        if job.phase == "PENDING" or job.workers + job.draining_workers == 0:
            cancel.append(job.job_id)
        else:
            release.append(job.job_id)
    if not cancel and not release:
        return BurstDecision(reason=f"burst: {capacity} slots held or asked for, {beyond} needed beyond the allocation")
    holds = f" ({_waiting_said(*waiting)})" if on_hold else ""
    return BurstDecision(cancel=tuple(cancel), release=tuple(release),
                         reason=f"burst: {beyond} slots needed beyond the allocation; giving back "
                                f"{len(cancel)} job(s) now{holds}, releasing {len(release)}")


def _grow(policy: BurstPolicy, missing: int, live_jobs: int, last_submit_s: float | None, now_s: float,
          cancel: tuple[int, ...], keep: tuple[int, ...], waiting: tuple[int, int] = (0, 0)) -> BurstDecision:
    wanted = math.ceil(missing / policy.worker_slots_per_job)
    room = max(0, policy.max_jobs - live_jobs)
    if room == 0:
        holds = f", {_waiting_said(*waiting, how=True)}" if sum(waiting) else ""
        return BurstDecision(cancel=cancel, keep=keep, reason=f"burst: {missing} slots missing, but max_jobs "
                                                   f"({policy.max_jobs}) burst jobs exist{holds}")
    if last_submit_s is not None and now_s - last_submit_s < policy.submit_cooldown_s:
        wait_s = policy.submit_cooldown_s - (now_s - last_submit_s)
        return BurstDecision(cancel=cancel, keep=keep, reason=f"burst: {missing} slots missing; submit cooldown, {wait_s:.0f} s left")
    submit = min(wanted, room)
    return BurstDecision(submit=submit, cancel=cancel, keep=keep,
                         reason=f"burst: {missing} slots missing beyond the allocation: submitting {submit} job(s)")


def _waiting_said(held: int, suspended: int, how: bool = False) -> str:
    """The jobs waiting on someone, held apart from suspended: each is undone another way."""
    said = []
    if held:
        said.append(f"{held} of them pending on a hold" + (" (scontrol release, or scancel, lets the pool ask again)"
                                                           if how else ""))
    if suspended:
        said.append(f"{suspended} of them suspended" + (" (scontrol resume brings its workers back; it is given "
                                                        "back after the admission TTL)" if how else ""))
    return ", ".join(said)


def as_judged(jobs: Iterable[BurstJob], given_back: frozenset[int], completing_since_s: Mapping[int, float],
              now_s: float) -> tuple[BurstJob, ...]:
    """The listing as :func:`decide_burst` weighs it: a completing job is over for good, not one
    that may be requeued, when this controller gave it back (``given_back``: it cancelled it) or
    once it has been completing for ``COMPLETING_WAIT_S`` (``completing_since_s``: first seen so)."""
    return tuple(replace(j, completing=False) if j.completing and (
        j.job_id in given_back or now_s - completing_since_s.get(j.job_id, now_s) >= COMPLETING_WAIT_S) else j
        for j in jobs)


@dataclass(frozen=True)
class RunOutcomes:
    """What became of the runs not over at the previous listing."""

    lost: tuple[int, ...] = ()  # ended without being given back: preempted, timed out, cancelled by others
    requeued: tuple[int, ...] = ()  # listed pending again under the same id: Slurm requeued them
    running: frozenset[int] = frozenset()  # not over for sure: running, or completing (ends or is requeued)


def run_outcomes(was_running: Iterable[int], current: Iterable[BurstJob], given_back: frozenset[int]) -> RunOutcomes:
    """Sort the runs of ``was_running`` by this listing. A job pending again is a requeue
    (``scontrol requeue``/``requeuehold``, a preemption with ``PreemptMode=REQUEUE``): not lost,
    it comes back as a new run. A completing one is told apart at a later listing, and a suspended
    one is not over (resumed, its run goes on). One that ended otherwise, or that Slurm lists no
    more, is lost unless it is in ``given_back``."""
    by_id = {j.job_id: j for j in current}
    before = set(was_running)
    running = frozenset(j.job_id for j in by_id.values()
                        if j.phase == "RUNNING" or ((j.completing or j.suspended) and j.job_id in before))
    lost: list[int] = []
    requeued: list[int] = []
    for job_id in sorted(before - running):
        job = by_id.get(job_id)
        if job is not None and job.phase == "PENDING" and not job.suspended:
            requeued.append(job_id)
        elif job_id not in given_back:
            lost.append(job_id)
    return RunOutcomes(tuple(lost), tuple(requeued), running)


def pending_lost(was_pending: Iterable[int], current: Iterable[BurstJob], given_back: frozenset[int]) -> tuple[int, ...]:
    """Jobs pending at the previous listing that Slurm now lists ended or no more, not given back by
    this controller: cancelled from outside (``scancel``) or refused by Slurm before they ran, so
    lost like a run that ends unreleased. One that runs now is followed by :func:`run_outcomes`."""
    live = {j.job_id for j in current if j.phase != "ENDED" or j.completing or j.suspended}
    return tuple(sorted(set(was_pending) - live - given_back))


def burst_first_drain_order(worker_jobs: dict[str, int], parent_job_id: int,
                            releasing: frozenset[int]) -> list[str]:
    """Worker ids in the order a scale-down should drain them: workers of released burst jobs,
    then of other burst jobs, then of the parent allocation (so GPUs go back to the cluster first)."""
    def rank(worker_id: str) -> tuple[int, str]:
        job = worker_jobs[worker_id]
        return (0 if job in releasing else 1 if job != parent_job_id else 2, worker_id)
    return sorted(worker_jobs, key=rank)
