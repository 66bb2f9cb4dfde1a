"""The trace simulator: a discrete-event replay of a workload through the real control code.

Pure: a simulated clock, seeded RNG streams, no I/O. What runs is the controller's own code:
each tick is :func:`~slurm_elastic.core.tick.tick` on an
:class:`~slurm_elastic.core.tick.Observation` of the simulated steps, the queue's
:class:`~slurm_elastic.core.pressure.QueueSnapshot` and the workers' busy time, so the worker
count (the policy: :mod:`slurm_elastic.core.scaling` or a baseline, in the autoscaler's seat),
launches, drain order, crash-loop backoff, crash cordons and drain timeouts are the
controller's; the :class:`~slurm_elastic.core.staleness.StalenessManager` with its drop rule
(:func:`~slurm_elastic.core.staleness.is_untrainable`) is the queue's. What is modelled:

- a worker step is STARTING for ``startup_s`` (launch -> registration), then ACTIVE; it loads
  its model for ``warmup_s``, then loops: ask admission for a group (the staleness gate, AReaL's
  capacity), generate it (a sampled rollout time, scaled by the phase and any throttle of its
  GPU), submit it (waits while the buffer is full). A drain lets the rollout in flight finish and
  be submitted, then the step exits; a drain while waiting for admission exits at once.
- the bounded buffer; the trainer pulls exactly ``batch_size`` sequences, computes, publishes
  version + 1; every group older than ``max_staleness`` versions is dropped at the pull.
- the controller ticks every ``tick_interval_s``: it measures as the queue does (consumption
  over 60 s, production and the workers' busy time over 120 s: seconds inside a rollout, which
  the SDK reports in heartbeats, here at every tick; the trainer's step and waits from its
  pulls), runs the tick and acts: cancels and drains first, then
  launches (a slot freed this tick is reused at once). One node, ``gpu_slots`` GPUs; Slurm's
  GPU choice is the lowest free GPU that is not cordoned.
- failures kill running steps (their rollout in flight is lost); the controller sees the step
  gone at its next tick, releases its admission, as the queue's controller does, and relaunches
  after the crash-loop backoff.

Blocking waits (admission, a full buffer, the trainer's pull) wake on the event that can end
them rather than polling every 0.2 s, which the real loops do; the difference is below a tick.
"""

from __future__ import annotations

import heapq

from slurm_elastic.core.lifecycle import WorkerState, commands_ended
from slurm_elastic.core.pressure import QueueSnapshot
from slurm_elastic.core.reconcile import Cancel, Drain, Launch, ObservedStep
from slurm_elastic.core.scaling import Decision, effective_setpoint_seqs
from slurm_elastic.core.tick import (
    Observation,
    TickAction,
    autoscaler_inputs,
    tick,
)
from slurm_elastic.sim.policies import initial_workers
from slurm_elastic.sim.results import Sample, ScaleEvent, SimResult, count_reversals, run_metrics
from slurm_elastic.sim.trace import Trace
from slurm_elastic.sim.workload import NODE, SimulatedWorkload

S = WorkerState
EXECUTION_ORDER = {Cancel: 0, Drain: 1, Launch: 2}  # a tick's actions: cancels and drains, then launches


class Simulation(SimulatedWorkload):
    """One run of one policy on one trace with one seed; :meth:`run` returns the result."""

    # ---- the event loop ----------------------------------------------------------------------
    def run(self) -> SimResult:
        self.start(initial_workers(self.policy_name, self.trace))
        self.advance(self.trace.duration_s)
        return self.finish()

    def start(self, workers: int) -> None:
        """t = 0: launch ``workers``, the trainer waits for its first batch, the ticks begin."""
        for failure in self.trace.failures:
            self._at(failure.at_s, "fail", str(failure.workers))
        self.act_now(workers)
        self.trainer_steps.asked(self.now_s)
        self._trainer_try_pull()
        self._at(self.trace.cluster.tick_interval_s, "tick")

    def act_now(self, workers: int) -> None:
        """Tick at once with ``workers`` as the operator's target (a schedule set from outside)."""
        self.state.manual_target = workers
        self._control()
        self.state.manual_target = None

    def trainer_idle_s(self) -> float:
        """Seconds the trainer has waited for a full batch so far, a wait in progress included."""
        waiting = 0.0 if self.trainer_waiting_since is None else self.now_s - self.trainer_waiting_since
        return self.counters["trainer_idle_s"] + waiting

    def advance(self, until_s: float) -> None:
        """Handle every event up to ``until_s`` (at most the trace's end); the clock ends there."""
        until_s = min(until_s, self.trace.duration_s)
        while self._events and self._events[0][0] <= until_s:
            t_s, _seq, kind, worker_id, epoch = heapq.heappop(self._events)
            self.now_s = t_s
            if kind == "tick":
                self._tick()
                self._at(t_s + self.trace.cluster.tick_interval_s, "tick")
            elif kind == "trainer_done":
                self._trainer_done()
            elif kind == "fail":
                self._fail(int(worker_id))
            else:
                proc = self.procs.get(worker_id)
                if proc is not None and proc.epoch == epoch:
                    self._worker_event(proc, kind)
        self.now_s = max(self.now_s, until_s)

    def finish(self) -> SimResult:
        """The metrics at the trace's end (call once, after :meth:`advance` to the end)."""
        end = self.now_s = self.trace.duration_s
        if self.trainer_waiting_since is not None:
            self.counters["trainer_idle_s"] += end - self.trainer_waiting_since
        for proc in self.procs.values():
            self.counters["gpu_s"] += end - proc.launched_s
        window_s = max(self.trace.autoscaler.scale_up_cooldown_s, self.trace.autoscaler.scale_down_cooldown_s)
        metrics = run_metrics(self.counters, end, self.max_staleness, self.queued_seqs,
                              count_reversals(self.scale_events, window_s), len(self.scale_events))
        return SimResult(self.trace.name, self.policy_name, self.seed, end, metrics, self.samples, self.scale_events)

    # ---- the controller ----------------------------------------------------------------------
    def queue_snapshot(self) -> QueueSnapshot:
        """The buffer's numbers as the queue reports them (:meth:`RolloutQueue.snapshot`)."""
        q = self.trace.queue
        return QueueSnapshot(self.queued_seqs, q.batch_size, self.pulls.rate(self.now_s), self.accepts.rate(self.now_s),
                             self.staleness.running, q.max_staleness, self.staleness.capacity(), q.capacity_seqs,
                             self.trainer_steps.step_s(self.now_s), self.trainer_steps.waiting(),
                             round(self.accepts.total(self.now_s)), self.trainer_steps.latest_step_s(self.now_s),
                             self.group_sizes.smallest())

    def observe(self) -> Observation:
        """What the controller sees: every simulated step, the queue, the workers' busy time."""
        steps = tuple(ObservedStep(p.worker_id, p.worker_id, NODE) for p in self.procs.values())
        return Observation(steps, queue=self.queue_snapshot(), busy_worker_s=self.busy.total(self.now_s))

    def _tick(self) -> None:
        self.grants.expire(self.now_s)
        self._serve_admissions()
        busy_s = 0.0
        for worker_id, proc in self.procs.items():
            record = self.records[worker_id]
            if proc.registered:
                record.last_heartbeat_s = self.now_s
                record.busy = proc.phase in ("rollout", "submit")
                so_far_s = proc.busy_s + (0.0 if proc.rollout_since_s is None else self.now_s - proc.rollout_since_s)
                busy_s += so_far_s - proc.busy_reported_s
                proc.busy_reported_s = record.busy_s = so_far_s
            if record.state is S.DRAINING and not proc.drain:  # the heartbeat reply says "drain"
                self._drain(proc)
        self.busy.add(self.now_s, busy_s)
        before = sum(1 for w in self.records.values() if w.counts_as_capacity)
        self.seat.inputs = self.seat.decision = None
        obs = self._control()
        x = self.seat.inputs or autoscaler_inputs(self.state, obs, self.trace.cluster.gpu_slots, self.tick_cfg)
        decision = self.seat.decision or Decision(self.state.target_workers, "hold", "")
        if decision.action in ("scale_up", "scale_down") and decision.target_workers != before:
            self.scale_events.append(ScaleEvent(self.now_s, decision.action, before, decision.target_workers,
                                                decision.reason))
        setpoint = effective_setpoint_seqs(self.trace.autoscaler, x)
        self.samples.append(Sample(self.now_s, x.queued_seqs or 0.0, setpoint, x.buffer_capacity_seqs or 0.0,
                                   x.staleness_capacity_seqs or 0.0, x.workers_starting, x.workers_active,
                                   x.workers_draining, decision.target_workers, decision.action, self.version))

    def _control(self) -> Observation:
        """One controller tick on what it observes now; its actions run at once."""
        obs = self.observe()
        result = tick(obs, self.state, self.tick_cfg, self.allocations, self.now_s)
        if "error" in self.state.last_decision:  # the controller holds on; a replay must not hide it
            raise RuntimeError(f"the policy failed at t = {self.now_s:.1f} s: {self.state.last_decision['error']}")
        launched = {a.worker_id for a in result.actions if isinstance(a, Launch)}
        for worker_id in commands_ended(self.records.values(), launched):  # as the controller does
            self.grants.release(worker_id)
        for action in sorted(result.actions, key=_execution_rank):
            if isinstance(action, Launch):
                self._launch(action.worker_id)
            elif isinstance(action, (Drain, Cancel)) and (proc := self.procs.get(action.worker_id)):
                self._drain(proc) if isinstance(action, Drain) else self._exit(proc, killed=True)
        for worker_id in [w for w, r in self.records.items() if r.state is S.INACTIVE and w not in self.procs]:
            del self.records[worker_id]
        return obs


def _execution_rank(action: TickAction) -> int:
    return EXECUTION_ORDER.get(type(action), len(EXECUTION_ORDER))


def simulate(trace: Trace, policy: str = "ours", seed: int | None = None) -> SimResult:
    """Replay ``trace`` under ``policy`` (see :data:`~slurm_elastic.sim.policies.POLICIES`)."""
    return Simulation(trace, policy, seed).run()
