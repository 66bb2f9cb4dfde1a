"""The level-triggered reconcile step: compare what Slurm runs with what is wanted, decide actions.

Pure: it updates the worker records (state transitions) and returns actions; the controller
runs the actions afterwards, and their errors come back as data on the next tick.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slurm_elastic.core.defaults import (
    BACKOFF_BASE_S,
    BACKOFF_MAX_S,
    DRAIN_TIMEOUT_S,
    HEARTBEAT_GRACE_S,
    START_TIMEOUT_S,
    STEP_END_SETTLE_S,
)
from slurm_elastic.core.lifecycle import (
    Worker,
    WorkerState,
    begin_drain,
    resume,
    suspend,
    transition,
)
from slurm_elastic.core.liveness import drain_not_live
from slurm_elastic.core.naming import format_worker_id
from slurm_elastic.core.speed import drain_order

S = WorkerState


@dataclass(frozen=True)
class ObservedStep:
    """One of our worker steps as listed by Slurm this tick."""

    worker_id: str
    step_id: str
    node: str  # the step's first node (where rank 0 runs)
    job_id: int = 0  # the Slurm job the step belongs to; 0: the controller's own job
    nodes: tuple[str, ...] = ()  # every node of the step (several for a multi-node worker)


EXITED_CLEANLY = "exited cleanly"  # a worker that left on its own with exit code 0 (history reason)
CANCELLED_BY_SOMEONE_ELSE = "its step was cancelled by someone else than the controller (scancel, or its srun killed)"
LAUNCH_NEVER_RAN = ("its launch was saved, but no srun runs for it and no step appeared: the controller "
                    "before this one stopped between saving the launch and running srun")


@dataclass(frozen=True)
class ReconcileConfig:
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    heartbeat_grace_s: float = HEARTBEAT_GRACE_S
    start_timeout_s: float = START_TIMEOUT_S  # launched -> registered, else the launch failed
    backoff_base_s: float = BACKOFF_BASE_S
    backoff_max_s: float = BACKOFF_MAX_S
    kill_resend_s: float = 30.0  # re-send a cancel that did not take
    liveness_failure_threshold: int = 0  # servers: failed liveness probes in a row that drain one; 0: off
    step_end_settle_s: float = STEP_END_SETTLE_S  # a step gone without an exit waits for Slurm's CANCELLED line


@dataclass(frozen=True)
class Launch:
    worker_id: str
    exclude_nodes: tuple[str, ...]
    job_id: int = 0  # the allocation to launch into; 0: the controller's own job


@dataclass(frozen=True)
class Drain:
    worker_id: str
    step_id: str
    job_id: int = 0  # the job of the worker's step; 0: the controller's own job


@dataclass(frozen=True)
class Cancel:
    worker_id: str
    step_id: str
    reason: str
    job_id: int = 0  # the job of the worker's step; 0: the controller's own job


@dataclass(frozen=True)
class Crashed:
    """An event, not an action: a worker died on (node, gpus); GPU health counts these on every
    GPU of its step (``gpu_keys``: all its nodes'; Slurm does not say which node's task failed)."""

    worker_id: str
    node: str
    gpus: tuple[int, ...]
    reason: str
    gpu_keys: tuple[tuple[str, int], ...] = ()
    counted: bool = True  # against its GPUs; not when someone else cancelled its step (an operator's scancel)


@dataclass(frozen=True)
class Resumed:
    """An event, not an action: a SUSPENDED worker's burst job runs again, and it goes on as it
    was (its step, its admissions); ``stopped_s``: how long it stood still."""

    worker_id: str
    job_id: int
    stopped_s: float


Action = Launch | Drain | Cancel


@dataclass
class Plan:
    actions: list[Action] = field(default_factory=list)
    crashes: list[Crashed] = field(default_factory=list)
    resumed: list[Resumed] = field(default_factory=list)
    next_number: int = 1


def backoff_s(crash_count: int, cfg: ReconcileConfig) -> float:
    """Exponential crash-loop backoff: base, 2*base, 4*base, ... capped at backoff_max_s."""
    return float(min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** max(0, crash_count - 1)))


def reconcile(
    workers: dict[str, Worker],
    observed: list[ObservedStep] | None,
    desired: int,
    allowed_slots: int,
    exclude_nodes: tuple[str, ...],
    cordoned: frozenset[tuple[str, int]],
    cfg: ReconcileConfig,
    now_s: float,
    next_number: int,
    drain_first_jobs: frozenset[int] = frozenset(),
    cancelled: frozenset[str] = frozenset(),
    never_ran: frozenset[str] = frozenset(),
    why_fewer: str = "",
    stopped_jobs: frozenset[int] = frozenset(),
    alive_jobs: frozenset[int] | None = None,
) -> Plan:
    """One tick. ``observed`` None means Slurm could not be listed: keep everything as it is.
    A scale-down drains workers in ``drain_first_jobs`` (burst jobs) before any other. ``cancelled``:
    workers whose step Slurm says was cancelled (by anyone: the controller's own cancels are known).
    ``never_ran``: STARTING workers an earlier controller saved a launch for and whose srun never
    ran (none runs, no step is listed): relaunched at once, not counted. ``why_fewer``: what a
    scale-down's drains say instead of "scale-down to N". ``stopped_jobs``: burst jobs Slurm lists
    suspended; their workers' steps are stopped (and not listed: only running jobs' are): they
    are SUSPENDED, not counted, and keep their admissions (:func:`_handle_suspended`).
    ``alive_jobs``: the burst jobs Slurm lists with processes that may still run (running,
    suspended, completing); None: not known (every SUSPENDED worker waits)."""
    plan = Plan(next_number=next_number)
    if observed is None:
        return plan
    by_id = {o.worker_id: o for o in observed}
    _adopt_and_refresh(workers, by_id, now_s, plan)
    _handle_suspended(workers, by_id, cfg, now_s, stopped_jobs, drain_first_jobs, alive_jobs)
    _handle_vanished(workers, by_id, cfg, now_s, plan, cancelled, never_ran, stopped_jobs)
    for worker in drain_not_live(workers.values(), cfg.liveness_failure_threshold, now_s):
        if worker.step_id:
            plan.actions.append(Drain(worker.worker_id, worker.step_id, worker.job_id))
    _enforce_heartbeats_and_timeouts(workers, cfg, cordoned, now_s, plan)
    _scale(workers, desired, allowed_slots, exclude_nodes, cfg, cordoned, now_s, plan, drain_first_jobs, why_fewer)
    return plan


def move_clocks_on(workers: dict[str, Worker], paused_s: float, now_s: float) -> None:
    """The controller did not run for ``paused_s`` (a suspended job, a stopped process): nobody could
    heart-beat, register or end a drain to it, so each running worker's heartbeat, start and drain
    clocks move on by that time (never past ``now_s``)."""
    for worker in workers.values():
        if not worker.has_step:
            continue
        worker.last_heartbeat_s = min(now_s, worker.last_heartbeat_s + paused_s)
        if worker.state is S.STARTING:
            worker.launched_at_s = min(now_s, worker.launched_at_s + paused_s)
        elif worker.state is S.DRAINING:
            worker.drain_started_s = min(now_s, worker.drain_started_s + paused_s)


def end_earlier_run(workers: dict[str, Worker], job_id: int, now_s: float) -> list[str]:
    """The job was requeued: every step of its earlier run ended with that run. Its workers end
    (INACTIVE), not counted as crashes of their GPUs; the target launches new ones. Workers in
    burst jobs (other jobs) are left to the listing. Returns the ids of the workers ended."""
    ended = []
    for worker in workers.values():
        if worker.has_step and worker.job_id in (0, job_id):
            transition(worker, S.INACTIVE, now_s, "its step ended with the job's earlier run (requeued)")
            _forget_step(worker)
            ended.append(worker.worker_id)
    return ended


def release_placeholders(workers: dict[str, Worker], reason: str, now_s: float) -> list[Cancel]:
    """The cancels of every placeholder's step, each placeholder ended (INACTIVE, ``reason``) at
    once: at an operator's stop no controller follows to see the steps leave, and a placeholder
    would hold its GPU until the job ends."""
    cancels = []
    for worker in workers.values():
        if worker.placeholder and worker.has_step and worker.step_id:
            cancels.append(Cancel(worker.worker_id, worker.step_id, reason, worker.job_id))
            transition(worker, S.INACTIVE, now_s, reason)
            step_id = worker.step_id
            _forget_step(worker)
            worker.step_id = step_id  # kept: a listing taken before the cancel still shows it, not to be adopted
    return cancels


def _adopt_and_refresh(workers: dict[str, Worker], by_id: dict[str, ObservedStep], now_s: float,
                       plan: Plan) -> None:
    for worker_id, step in by_id.items():
        if worker_id.isdigit():
            plan.next_number = max(plan.next_number, int(worker_id) + 1)
        worker = workers.get(worker_id)
        if worker is not None and worker.state is S.SUSPENDED:
            if (worker.step_id, worker.job_id) == (step.step_id, step.job_id):
                _resume(worker, f"its burst job {worker.job_id} runs again: its step {step.step_id} goes on",
                        now_s, plan)
                continue
            transition(worker, S.INACTIVE, now_s, f"another step of its id runs ({step.job_id}.{step.step_id})")
            _forget_step(worker)
        if worker is None or worker.state in (S.INACTIVE, S.FAILED, S.BACKOFF):
            if worker is not None and worker.step_id == step.step_id:
                continue  # the old step of a finished record is still winding down
            adopted = Worker(worker_id=worker_id, step_id=step.step_id, node=step.node, job_id=step.job_id,
                             nodes=step.nodes, launched_at_s=now_s, last_heartbeat_s=now_s, launches=1)
            if worker is not None:
                adopted.crash_count, adopted.launches = worker.crash_count, worker.launches
                adopted.history = worker.history
            adopted.history.append((now_s, "", S.STARTING.value, f"adopted running step {step.step_id}"))
            workers[worker_id] = adopted
            continue
        worker.step_id, worker.node = step.step_id, step.node
        worker.nodes = step.nodes or worker.nodes


def _handle_suspended(workers: dict[str, Worker], by_id: dict[str, ObservedStep], cfg: ReconcileConfig,
                      now_s: float, stopped_jobs: frozenset[int], running_jobs: frozenset[int],
                      alive_jobs: frozenset[int] | None) -> None:
    """SUSPENDED workers whose step is not listed (one listed again is resumed where the listing is
    read). They wait while their job is suspended or completing (its processes are being ended:
    a submit under their admissions may still come). Their job running again without their step
    for ``step_end_settle_s`` (requeued while suspended: a new run, the old processes gone; the
    wait covers a job listing taken after the resume and a step listing before it), or gone from
    Slurm's listing (cancelled, ended, pending again): they end, not counted against their GPUs,
    and what the queue granted them is released."""
    for worker in workers.values():
        if worker.state is not S.SUSPENDED or worker.worker_id in by_id or worker.job_id in stopped_jobs:
            continue
        if worker.job_id in running_jobs:
            worker.vanished_at_s = worker.vanished_at_s or now_s
            if now_s - worker.vanished_at_s < cfg.step_end_settle_s:
                continue
            reason = "runs again without its step (requeued while suspended)"
        elif alive_jobs is not None and worker.job_id not in alive_jobs:
            reason = "ended while suspended"
        else:
            continue
        transition(worker, S.INACTIVE, now_s, f"its burst job {worker.job_id} {reason}; not counted against its GPU")
        _forget_step(worker)


def _resume(worker: Worker, reason: str, now_s: float, plan: Plan) -> None:
    plan.resumed.append(Resumed(worker.worker_id, worker.job_id, resume(worker, now_s, reason)))


def _handle_vanished(workers: dict[str, Worker], by_id: dict[str, ObservedStep], cfg: ReconcileConfig,
                     now_s: float, plan: Plan, cancelled: frozenset[str] = frozenset(),
                     never_ran: frozenset[str] = frozenset(), stopped_jobs: frozenset[int] = frozenset()) -> None:
    for worker in workers.values():
        if not worker.has_step or worker.worker_id in by_id:
            continue
        unlisted_launch = worker.state is S.STARTING and not worker.step_id
        if worker.job_id in stopped_jobs and worker.step_id:  # only running burst jobs' steps are listed
            # not cancelled: Slurm 22.05's scancel of a suspended job's step blocks until the job resumes
            # its admissions stay counted in flight; it goes on when the job resumes (a placeholder as one)
            suspend(worker, now_s, f"its burst job {worker.job_id} is suspended (its step stopped); not counted "
                    "against its GPU")
            continue
        elif unlisted_launch and worker.worker_id in never_ran:
            _relaunch_uncounted(worker, LAUNCH_NEVER_RAN, now_s, plan)
        elif unlisted_launch and now_s - worker.launched_at_s < cfg.start_timeout_s:
            continue  # launched, not listed yet
        elif worker.state is S.DRAINING and not worker.failure_reason:
            transition(worker, S.INACTIVE, now_s, "step ended after drain" if not worker.kill_sent_s
                       else f"step cancelled at the drain timeout ({cfg.drain_timeout_s:g} s)")
        elif worker.placeholder:
            transition(worker, S.INACTIVE, now_s, "placeholder released")
        elif worker.exit_code == 0 and worker.state is not S.DRAINING and not worker.failure_reason:
            transition(worker, S.INACTIVE, now_s, EXITED_CLEANLY)
        elif worker.worker_id in cancelled and not worker.failure_reason:  # by someone else: not its GPU's fault
            _relaunch_uncounted(worker, CANCELLED_BY_SOMEONE_ELSE, now_s, plan)
        elif _word_on_why_may_follow(worker, cfg, now_s):
            continue
        else:
            reason = worker.failure_reason or (
                "step never appeared in Slurm" if not worker.step_id
                else f"step ended unexpectedly (exit code {worker.exit_code})" if worker.exit_code is not None
                else "step ended unexpectedly")
            transition(worker, S.FAILED, now_s, reason)
            worker.crash_count += 1  # its own backoff grows either way
            plan.crashes.append(Crashed(worker.worker_id, worker.node, worker.gpus, reason, worker.gpu_keys,
                                        counted=not worker.gpu_blameless))
            worker.backoff_until_s = now_s + backoff_s(worker.crash_count, cfg)
            transition(worker, S.BACKOFF, now_s, f"crash-loop backoff {backoff_s(worker.crash_count, cfg):g} s")
        _forget_step(worker)


def _relaunch_uncounted(worker: Worker, reason: str, now_s: float, plan: Plan) -> None:
    """Its step ended (or never began) through no fault of its GPU: relaunched at once, not counted."""
    transition(worker, S.FAILED, now_s, reason)
    plan.crashes.append(Crashed(worker.worker_id, worker.node, worker.gpus, reason, worker.gpu_keys, counted=False))
    worker.backoff_until_s = now_s
    transition(worker, S.BACKOFF, now_s, "relaunch at once")


def _forget_step(worker: Worker) -> None:
    """Clear what belonged to the step that ended."""
    worker.step_id, worker.kill_sent_s, worker.failure_reason, worker.exit_code = "", 0.0, "", None
    worker.busy, worker.vanished_at_s, worker.terminated_by_signal, worker.gpu_blameless = False, 0.0, False, False


def _word_on_why_may_follow(worker: Worker, cfg: ReconcileConfig, now_s: float) -> bool:
    """A listed step that left with no exit reported (or one after a SIGTERM) and no kill of ours
    waits ``step_end_settle_s`` before it counts as a crash: srun writes Slurm's CANCELLED line to
    the step's output on its own time, and the listing can change first."""
    if not worker.step_id or worker.failure_reason or (worker.exit_code is not None and not worker.terminated_by_signal):
        return False
    if not worker.vanished_at_s:
        worker.vanished_at_s = now_s
    return now_s - worker.vanished_at_s < cfg.step_end_settle_s


def _enforce_heartbeats_and_timeouts(workers: dict[str, Worker], cfg: ReconcileConfig,
                                     cordoned: frozenset[tuple[str, int]], now_s: float, plan: Plan) -> None:
    for worker in workers.values():
        if not worker.step_id or not worker.has_step:  # a SUSPENDED one's step is stopped: no scancel (it blocks)
            continue
        silent_s = now_s - worker.last_heartbeat_s
        if worker.state in (S.ACTIVE, S.STARTING) and not worker.placeholder and silent_s > cfg.heartbeat_grace_s:
            reason = f"no heartbeat for {silent_s:.0f} s (grace {cfg.heartbeat_grace_s:g} s)"
            begin_drain(worker, now_s, reason, failure_reason=reason)
            _kill(worker, reason, now_s, plan)
        elif worker.state is S.DRAINING and now_s - worker.drain_started_s >= cfg.drain_timeout_s:
            if not worker.kill_sent_s or now_s - worker.kill_sent_s >= cfg.kill_resend_s:
                _kill(worker, f"drain timeout {cfg.drain_timeout_s:g} s reached", now_s, plan)
        elif (worker.placeholder and not worker.cordoned_gpus(cordoned)
              and (not worker.kill_sent_s or now_s - worker.kill_sent_s >= cfg.kill_resend_s)):
            _kill(worker, "GPU uncordoned: releasing placeholder", now_s, plan)


def _kill(worker: Worker, reason: str, now_s: float, plan: Plan) -> None:
    worker.kill_sent_s = now_s
    plan.actions.append(Cancel(worker.worker_id, worker.step_id, reason, worker.job_id))


def _scale(workers: dict[str, Worker], desired: int, allowed_slots: int, exclude_nodes: tuple[str, ...],
           cfg: ReconcileConfig, cordoned: frozenset[tuple[str, int]], now_s: float, plan: Plan,
           drain_first_jobs: frozenset[int] = frozenset(), why_fewer: str = "") -> None:
    capacity = [w for w in workers.values() if w.counts_as_capacity]
    holding = [w for w in workers.values() if w.has_step and not w.placeholder and not w.cordoned_gpus(cordoned)]
    free_slots = max(0, allowed_slots - len(holding))
    if len(capacity) > desired:
        drainable = [w for w in capacity if w.state is not S.DRAINING]
        for worker in drain_order(drainable, drain_first_jobs, cordoned)[: len(capacity) - desired]:
            if worker.state is S.BACKOFF:
                transition(worker, S.INACTIVE, now_s, "scale-down: relaunch cancelled")
            else:
                begin_drain(worker, now_s, why_fewer or f"scale-down to {desired}")
                if worker.step_id:
                    plan.actions.append(Drain(worker.worker_id, worker.step_id, worker.job_id))
        return
    for worker in sorted((w for w in capacity if w.state is S.BACKOFF), key=lambda w: w.backoff_until_s):
        if worker.backoff_until_s <= now_s and free_slots > 0:
            _launch(worker, exclude_nodes, now_s, "backoff over: relaunch", plan)
            free_slots -= 1
    for _ in range(max(0, desired - len(capacity))):
        if free_slots <= 0:
            break
        worker = Worker(worker_id=format_worker_id(plan.next_number))
        plan.next_number += 1
        worker.history.append((now_s, "", S.STARTING.value, f"scale-up to {desired}"))
        workers[worker.worker_id] = worker
        _launch(worker, exclude_nodes, now_s, "", plan, fresh=True)
        free_slots -= 1


def _launch(worker: Worker, exclude_nodes: tuple[str, ...], now_s: float, reason: str, plan: Plan,
            fresh: bool = False) -> None:
    if not fresh:
        transition(worker, S.STARTING, now_s, reason)
    worker.launched_at_s = now_s
    worker.last_heartbeat_s = now_s
    worker.step_id, worker.node, worker.gpus, worker.nodes, worker.node_gpus = "", "", (), (), {}
    worker.liveness_failures, worker.drained_by_its_step = 0, False
    worker.rollouts, worker.busy, worker.busy_s, worker.paused_busy_s = 0, False, 0.0, 0.0  # the new step's own
    worker.stood_s = 0.0
    worker.launches += 1
    plan.actions.append(Launch(worker.worker_id, exclude_nodes))
