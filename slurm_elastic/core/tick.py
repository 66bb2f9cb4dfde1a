"""One control tick: every decision of the controller, as data (pure: no I/O, the clock passed in).

The controller observes (one listing of the job's steps, the queue's numbers, the routers'
load), calls :func:`tick`, runs the returned actions and saves the state. The tick decides the
worker count (wake-all, the operator's target, a pause, or the autoscaler), drains workers on
unhealthy GPUs, reconciles (adoption, crashes and their backoff, heartbeats, drain timeouts,
placeholders, scale up and down), places launches on the allocations' free slots, sends server
drain signals once nothing is in flight at them, and keeps one health agent step per node.
It updates ``state`` in place (the records are the controller's) and returns what to do.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from slurm_elastic.core.cordons import CordonBook, CordonChange
from slurm_elastic.core.defaults import SERVER_DRAIN_GRACE_S
from slurm_elastic.core.lifecycle import Worker, WorkerState, begin_drain
from slurm_elastic.core.placement import Allocation, Slots, placement
from slurm_elastic.core.pressure import QueueSnapshot, pressure_inputs
from slurm_elastic.core.reconcile import (
    Cancel,
    Crashed,
    Drain,
    Launch,
    ObservedStep,
    ReconcileConfig,
    Resumed,
    move_clocks_on,
    reconcile,
)
from slurm_elastic.core.scaling import Autoscaler, Decision, PressureInputs

S = WorkerState
AGENT_RELAUNCH_S = 30.0


@dataclass(frozen=True)
class TickConfig:
    reconcile: ReconcileConfig
    gpus_per_worker: int = 1  # in all, over all its nodes
    nodes_per_worker: int = 1  # a worker's step spans this many nodes (gpus_per_worker / it on each)
    is_server: bool = False  # inference servers: out of discovery first, the drain signal later
    server_drain_grace_s: float = SERVER_DRAIN_GRACE_S
    agents: bool = False  # one health agent step per node
    agent_relaunch_s: float = AGENT_RELAUNCH_S
    end_drain_s: float = 0.0  # every worker drains this long before the job's time limit (0: never)


@dataclass(frozen=True)
class Observation:
    """What the controller saw this tick. ``steps`` None: Slurm did not answer (nothing changes
    on Slurm's account, the decisions that need no listing still run)."""

    steps: tuple[ObservedStep, ...] | None
    agent_nodes: frozenset[tuple[int, str]] = frozenset()  # (job, node) whose agent step runs
    foreign_gpus: Mapping[int, Mapping[str, int]] = field(default_factory=dict)  # job -> node -> GPUs held
    queue: QueueSnapshot | None = None
    busy_worker_s: float | None = None  # worker-seconds inside rollouts over the production window (None: not reported)
    outstanding_by_worker: Mapping[str, int] = field(default_factory=dict)  # servers: requests in flight
    total_outstanding: int | None = None  # servers: all requests in flight; None for other workers
    releasing_jobs: frozenset[int] = frozenset()  # burst jobs being emptied: their workers drain
    burst_slots_possible: int = 0  # slots burst jobs not yet held could add: the autoscaler may ask for them
    paused_s: float = 0.0  # the controller's process did not run this long since the last tick (a suspended job)
    stopped_jobs: frozenset[int] = frozenset()  # burst jobs listed SUSPENDED: their workers' steps are stopped
    alive_jobs: frozenset[int] | None = None  # burst jobs listed running, suspended or completing (None: unknown)
    cancelled_worker_ids: frozenset[str] = frozenset()  # steps gone from the listing that Slurm says were cancelled
    launches_never_ran: frozenset[str] = frozenset()  # saved launches of an earlier controller whose srun never ran
    time_left_s: float | None = None  # until the job's time limit (None: unknown)
    run_span_s: float | None = None  # the job's whole time, start to time limit (None: unknown)


class ScalingPolicy(Protocol):
    """What decides the worker count from the autoscaler's inputs: the :class:`Autoscaler`, or a
    baseline the simulator compares it with."""

    def decide(self, x: PressureInputs, now_s: float) -> Decision: ...


@dataclass
class ControlState:
    """What the controller decides over and saves between ticks."""

    autoscaler: Autoscaler
    cordons: CordonBook
    workers: dict[str, Worker] = field(default_factory=dict)
    next_number: int = 1
    target_workers: int = 0
    manual_target: int | None = None
    paused: bool = False
    wake_all_active: bool = False
    seed_target_from_slurm: bool = False  # no saved target: the first listing keeps what runs
    last_decision: dict[str, Any] = field(default_factory=lambda: {"action": "hold", "reason": "starting"})
    agent_launched_s: dict[tuple[int, str], float] = field(default_factory=dict)  # (job, node): its agent's last launch
    node_held_since_s: dict[tuple[int, str], float] = field(default_factory=dict)  # (job, node): since when it holds it
    foreign_gpus: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    listed_worker_ids: frozenset[str] = frozenset()  # worker steps in Slurm's latest listing
    started_s: float = float("-inf")  # this controller's start: a server's drain grace counts again from it
    policy: ScalingPolicy | None = None  # decides instead of the autoscaler (the simulator's baselines)


@dataclass(frozen=True)
class LaunchAgent:
    job_id: int
    node: str
    gpu_count: int


@dataclass(frozen=True)
class Note:
    """Something the controller logs (and, ``for_status``, shows in status as a saved-state note)."""

    message: str
    for_status: bool = False


TickAction = Launch | Drain | Cancel | LaunchAgent
TickEvent = Crashed | CordonChange | Note | Resumed


@dataclass
class TickResult:
    actions: list[TickAction] = field(default_factory=list)
    events: list[TickEvent] = field(default_factory=list)
    slots: tuple[Slots, ...] = ()  # per allocation: where workers may go now
    slots_once_heard: tuple[int, ...] = ()  # per allocation: the slots once the agents yet to report have
    kept_outside_slots: int = 0  # workers running where new ones may not go (a cordoned GPU, a silent agent's node)
    desired: int = 0


def tick(obs: Observation, state: ControlState, cfg: TickConfig, allocations: tuple[Allocation, ...],
         now_s: float) -> TickResult:
    """Decide everything for one tick; ``allocations[0]`` is the controller's own job."""
    result = TickResult()
    if obs.paused_s > 0:  # nobody could heart-beat or report to it meanwhile
        move_clocks_on(state.workers, obs.paused_s, now_s)
        state.cordons.move_clocks_on(obs.paused_s, now_s)
        state.autoscaler.skip_integration()
        result.events.append(Note(f"the controller did not run for {obs.paused_s:.0f} s (the job was suspended, or its "
                                  "process stopped): heartbeat, start, drain and agent timers moved on by that time"))
    state.cordons.tick(now_s)
    ending = _ending_burst_jobs(state, allocations)
    allocations = tuple(a for i, a in enumerate(allocations) if i == 0 or a.job_id not in ending)
    releasing = obs.releasing_jobs | ending
    health_drained = [*_drain_unhealthy(state, now_s), *_drain_released(state, releasing, now_s)]
    cordoned = frozenset(state.cordons.cordoned())
    if obs.steps is not None:
        state.foreign_gpus = obs.foreign_gpus
        state.listed_worker_ids = frozenset(o.worker_id for o in obs.steps)
        if state.seed_target_from_slurm:
            _seed_target(state, len(obs.steps), result)
    if cfg.agents:
        hold_nodes(state, allocations, now_s)
    awaiting = awaiting_first_reports(state, now_s) if cfg.agents else set()
    unknown = (state.cordons.unknown_nodes(now_s, nodes=[n for a in allocations for n in a.gpus_by_node]) | awaiting
               if cfg.agents else set())  # awaiting: also a node an earlier job's agent reported on
    own = frozenset(k for w in state.workers.values() if w.has_step for k in w.gpu_keys)
    result.slots = placement(allocations, cfg.gpus_per_worker, cordoned, unknown, state.foreign_gpus,
                             cfg.nodes_per_worker, own)
    allowed = sum(s.slots for s in result.slots)
    once_heard = placement(allocations, cfg.gpus_per_worker, cordoned, unknown - awaiting, state.foreign_gpus,
                           cfg.nodes_per_worker, own) if awaiting else result.slots
    result.slots_once_heard = tuple(s.slots for s in once_heard)
    running = [w for w in state.workers.values() if w.counts_as_capacity and w.has_step]
    on_cordoned = sum(1 for w in running if w.cordoned_gpus(cordoned))  # kept running where new ones may not go
    result.kept_outside_slots = on_cordoned + sum(1 for w in running if not w.cordoned_gpus(cordoned)
                                                  and set(w.all_nodes) & (unknown - awaiting))
    result.desired = desired_workers(state, obs, sum(result.slots_once_heard) + obs.burst_slots_possible, cfg, now_s,
                                     on_cordoned)
    exclude = result.slots[0].exclude_nodes if result.slots else ()
    burst_jobs = frozenset(a.job_id for a in allocations[1:]) | releasing
    plan = reconcile(state.workers, None if obs.steps is None else list(obs.steps), result.desired, allowed,
                     exclude, cordoned, cfg.reconcile, now_s, state.next_number, drain_first_jobs=burst_jobs,
                     cancelled=obs.cancelled_worker_ids, never_ran=obs.launches_never_ran,
                     stopped_jobs=obs.stopped_jobs, alive_jobs=obs.alive_jobs,
                     why_fewer="the job's time limit is near" if state.last_decision.get("action") == "drain" else "")
    state.next_number = plan.next_number
    result.events.extend(plan.resumed)
    held_nodes = {n for a in allocations for n in a.gpus_by_node}
    for crash in plan.crashes:
        result.events.append(crash)
        if not crash.counted:
            continue
        for node, gpu in crash.gpu_keys or [(crash.node, g) for g in crash.gpus]:  # repeated crashes cordon a GPU
            if node in held_nodes:  # a node that left the job (or an ended burst job) is not ours to cordon
                last = f"worker {crash.worker_id}, {crash.reason}; its output: logs/worker-{crash.worker_id}.out"
                result.events.extend(state.cordons.record_crash(node, gpu, now_s, last))
    launches = [a for a in plan.actions if isinstance(a, Launch)]
    result.actions.extend(_place(launches, state, result.slots, cordoned))
    result.actions.extend(a for a in plan.actions if isinstance(a, Cancel))
    drained = [*health_drained, *(state.workers[a.worker_id] for a in plan.actions if isinstance(a, Drain))]
    result.actions.extend(drain_signals(state, drained, cfg, obs.outstanding_by_worker, now_s))
    if obs.steps is not None and cfg.agents:
        result.actions.extend(_agents(state, obs.agent_nodes, allocations, cfg, now_s))
    return result


def hold_nodes(state: ControlState, allocations: Iterable[Allocation], now_s: float) -> None:
    """Note since when each node of ``allocations`` is held, per job: a later burst job that holds a
    node again starts its hold anew, also when it follows the one before within a tick."""
    held = {(a.job_id, n) for a in allocations for n in a.gpus_by_node}
    for key in set(state.node_held_since_s) - held:
        del state.node_held_since_s[key]
    for key in held:
        state.node_held_since_s.setdefault(key, now_s)


def awaiting_first_reports(state: ControlState, now_s: float) -> set[str]:
    """Held nodes whose health agent has not reported since they were taken (a job's start, a burst
    job's, a node held again), for at most ``agent_silence_s`` from then. No worker goes there
    before it reports, but the count reckons with their GPUs: deciding on the slots without them
    would drop ``workers.initial_workers`` at the first tick, and give a new burst job back.
    Bounded by the hold's start, not the agent's launch: an agent that never works (relaunched
    every ``agent_relaunch_s``) must not keep its node's GPUs counted."""
    silence_s = state.cordons.rules.agent_silence_s
    return {node for (_job, node), since_s in state.node_held_since_s.items()
            if ((heard_s := state.cordons.heard_s(node)) is None or heard_s < since_s)
            and now_s - since_s <= silence_s}


def desired_workers(state: ControlState, obs: Observation, allowed_slots: int, cfg: TickConfig, now_s: float,
                    on_cordoned: int = 0) -> int:
    """0 when the job's time limit is near (:func:`end_drain_reason`); the target kept for a raised
    limit is then the operator's (wake-all, ``scale``) or the autoscaler's last. Otherwise
    wake-all (a worker on every allowed GPU, plus the ``on_cordoned`` workers kept on cordoned
    ones), else the operator's target, else (unless paused) the autoscaler's decision, whose
    ceiling counts those kept workers too. A tick the autoscaler does not decide in is not
    integrated over when it decides again (:meth:`~slurm_elastic.core.autoscaler_memory.AutoscalerMemory.not_deciding`)."""
    near_end = end_drain_reason(obs, cfg)
    if state.wake_all_active or state.manual_target is not None or near_end is not None or state.paused \
            or not state.autoscaler.config.enabled:
        state.autoscaler.not_deciding(now_s)
    if state.wake_all_active:
        state.target_workers = allowed_slots + on_cordoned
        kept = f", and the {on_cordoned} kept on cordoned GPUs" if on_cordoned else ""
        state.last_decision = {"action": "hold", "reason": f"wake-all: every allowed GPU ({allowed_slots}){kept}"}
    elif state.manual_target is not None:
        state.target_workers = state.manual_target
        state.last_decision = {"action": "hold", "reason": f"manual target {state.manual_target} (autoscaler paused)"}
    elif near_end is not None:
        pass  # the autoscaler's last target is kept for a raised limit
    elif state.paused:
        state.last_decision = {"action": "hold", "reason": f"autoscaler paused at {state.target_workers}"}
    elif not state.autoscaler.config.enabled:
        state.last_decision = {"action": "hold", "reason": "autoscaler disabled ([autoscaler] enabled = false)"}
    else:
        policy = state.autoscaler if state.policy is None else state.policy
        try:
            # a worker kept on a cordoned GPU holds a slot of its own, outside the allowed ones
            decision = policy.decide(autoscaler_inputs(state, obs, allowed_slots + on_cordoned, cfg), now_s)
        except Exception as exc:  # a policy fault holds the count; the tick goes on (relaunches, drains, health)
            state.last_decision = {"action": "hold", "error": f"{type(exc).__name__}: {exc}",
                                   "reason": f"hold: the autoscaler failed ({type(exc).__name__}: {exc}); "
                                             f"the count stays at {state.target_workers}"}
            return state.target_workers
        state.target_workers = decision.target_workers
        state.last_decision = decision.to_dict()
    if near_end is not None:  # none runs before a raised limit
        state.last_decision = {"action": "drain", "reason": near_end}
        return 0
    return state.target_workers


def end_drain_reason(obs: Observation, cfg: TickConfig) -> str | None:
    """Why every worker drains now (each finishes its rollout and hands it over, none is launched):
    the job's time limit is less than ``end_drain_s`` away, or a quarter of the job's whole time in
    a job shorter than four times that. None otherwise, or while the time limit is unknown. A limit
    raised (``scontrol update``) or a requeued run moves the end, and the count is decided again."""
    if cfg.end_drain_s <= 0 or obs.time_left_s is None:
        return None
    window_s = cfg.end_drain_s if obs.run_span_s is None else min(cfg.end_drain_s, obs.run_span_s / 4)
    if obs.time_left_s > window_s:
        return None
    shortened = (f", capped at a quarter of the job's {obs.run_span_s:.0f} s: {window_s:.0f} s"
                 if window_s < cfg.end_drain_s and obs.run_span_s else "")
    return (f"the job's time limit is {max(0.0, obs.time_left_s):.0f} s away: every worker drains, finishing its "
            f"rollout, and none is launched (workers.end_drain_s = {cfg.end_drain_s:g} s{shortened}); the "
            "trainer takes what is buffered")


def autoscales(state: ControlState) -> bool:
    """Whether the autoscaler decides the count this tick (it alone reads the queue's numbers)."""
    return not (state.wake_all_active or state.manual_target is not None or state.paused
                or not state.autoscaler.config.enabled)


def autoscaler_inputs(state: ControlState, obs: Observation, allowed_slots: int, cfg: TickConfig) -> PressureInputs:
    """What the autoscaler sees: the queue's numbers, server load, workers by state, and how many
    are still loading (launched, no rollout started yet; known only where workers report busy time).
    Workers the target asks for that no tick has launched yet (``workers.initial_workers`` before
    the first tick) count as starting: a hold keeps them."""
    workers = [w for w in state.workers.values() if not w.placeholder]
    counts = Counter(w.state for w in workers)
    capacity = counts[S.STARTING] + counts[S.BACKOFF] + counts[S.ACTIVE]
    counts[S.STARTING] += max(0, min(state.target_workers, allowed_slots) - capacity)
    busy_worker_s = obs.busy_worker_s if obs.queue else None
    loading = 0 if busy_worker_s is None else sum(
        1 for w in workers if w.state is S.STARTING or (w.state is S.ACTIVE and w.rollouts == 0 and not w.busy))
    return pressure_inputs(obs.queue, counts, busy_worker_s, allowed_slots,
                           obs.total_outstanding if cfg.is_server else None, obs.burst_slots_possible, loading)


def operator_drain(state: ControlState, worker: Worker, cfg: TickConfig, outstanding_by_worker: Mapping[str, int],
                   now_s: float) -> list[TickAction]:
    """The operator drains one worker now (it is replaced if the target still asks for it)."""
    if worker.state is S.DRAINING:
        return []
    begin_drain(worker, now_s, "drained by operator")
    return list(drain_signals(state, [worker], cfg, outstanding_by_worker, now_s, only_these=True))


def drain_signals(state: ControlState, drained: Iterable[Worker], cfg: TickConfig,
                  outstanding_by_worker: Mapping[str, int], now_s: float, only_these: bool = False) -> list[Drain]:
    """The drain signals to send now. Other workers get theirs as they enter DRAINING; servers
    leave discovery first and get it once nothing is in flight at them and the grace is over
    (every draining server is checked each tick, unless ``only_these``). A restarted controller
    has heard no router yet: the grace counts again from its start."""
    if not cfg.is_server:
        due = [w for w in drained if w.step_id]
    else:
        pool = drained if only_these else state.workers.values()
        due = [w for w in pool if w.state is S.DRAINING and w.step_id and not w.drain_signaled
               and not w.placeholder and now_s - max(w.drain_started_s, state.started_s) >= cfg.server_drain_grace_s
               and outstanding_by_worker.get(w.worker_id, 0) == 0]
    for worker in due:
        worker.drain_signaled = True
    return [Drain(w.worker_id, w.step_id, w.job_id) for w in due]


def _drain_unhealthy(state: ControlState, now_s: float) -> list[Worker]:
    """Drain workers on GPUs that became unhealthy or whose node Slurm took out of use (as the
    rules say). Level-triggered."""
    targets = state.cordons.drain_targets()
    drained = []
    for worker in state.workers.values():
        hit = worker.cordoned_gpus(targets)
        if hit and worker.state in (S.ACTIVE, S.STARTING) and not worker.placeholder:
            node_out, health = state.cordons.entry(hit[0], "slurm"), state.cordons.entry(hit[0], "health")
            if node_out is not None and state.cordons.rules.on_node_out == "drain":
                begin_drain(worker, now_s, node_out.reason)
            else:
                begin_drain(worker, now_s, f"GPU {hit[0][0]}:{hit[0][1]} unhealthy: {health.reason if health else 'cordoned'}")
            drained.append(worker)
    return drained


def _ending_burst_jobs(state: ControlState, allocations: tuple[Allocation, ...]) -> frozenset[int]:
    """Burst jobs a worker left on its own (exit 0 reported, no drain asked), or one whose step got
    the drain signal from outside: Slurm signalled the job's end (a preemption, its time limit).
    Nothing new goes there from this tick on."""
    own = allocations[0].job_id if allocations else 0
    return frozenset(w.job_id for w in state.workers.values() if w.job_id not in (0, own) and (
        (w.exit_code == 0 and w.state in (S.STARTING, S.ACTIVE)) or (w.drained_by_its_step and w.has_step)))


def _drain_released(state: ControlState, releasing_jobs: frozenset[int], now_s: float) -> list[Worker]:
    """Drain the workers of burst jobs being given back (level-triggered: the mark is in Slurm);
    not one that left on its own already (its clean exit is what marks its job as ending)."""
    if not releasing_jobs:
        return []
    drained = []
    for worker in state.workers.values():
        if (worker.job_id in releasing_jobs and worker.state in (S.ACTIVE, S.STARTING) and worker.has_step
                and worker.exit_code != 0):
            begin_drain(worker, now_s, f"burst job {worker.job_id} given back")
            drained.append(worker)
    return drained


def _seed_target(state: ControlState, running: int, result: TickResult) -> None:
    """Without saved state, keep the worker steps that already run: never tear down a live fleet."""
    state.seed_target_from_slurm = False
    if running > state.target_workers:
        result.events.append(Note(f"no saved state: keeping the {running} worker steps Slurm runs; cordons, a "
                                  "manual target or a pause set before are not known (set them again)", True))
        state.target_workers = running


def _place(launches: list[Launch], state: ControlState, slots: tuple[Slots, ...],
           cordoned: frozenset[tuple[str, int]]) -> list[Launch]:
    """Each launch goes to the first allocation with a free slot (the first one if none is free)."""
    if not slots:
        return launches
    launching = {a.worker_id for a in launches}
    free = {s.job_id: s.slots for s in slots}
    for w in state.workers.values():
        if w.has_step and not w.placeholder and w.worker_id not in launching and not w.cordoned_gpus(cordoned):
            job = w.job_id or slots[0].job_id
            free[job] = free.get(job, 0) - 1
    placed = []
    for launch in launches:
        where = next((s for s in slots if free[s.job_id] > 0), slots[0])
        free[where.job_id] -= 1
        state.workers[launch.worker_id].job_id = where.job_id
        placed.append(replace(launch, exclude_nodes=where.exclude_nodes, job_id=where.job_id))
    return placed


def _agents(state: ControlState, running: frozenset[tuple[int, str]], allocations: tuple[Allocation, ...], cfg: TickConfig,
            now_s: float) -> list[LaunchAgent]:
    """One agent step per node of each job (all of the node's GPUs); a vanished one is relaunched
    after a pause. A burst job that holds a node again gets its own at once."""
    launches = []
    for allocation in allocations:
        for node, gpus in allocation.gpus_by_node.items():
            key = (allocation.job_id, node)
            if key in running or now_s - state.agent_launched_s.get(key, -1e9) < cfg.agent_relaunch_s:
                continue
            state.agent_launched_s[key] = now_s
            launches.append(LaunchAgent(allocation.job_id, node, len(gpus)))
    return launches
