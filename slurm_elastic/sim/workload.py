"""The simulated workload: worker steps and the trainer, run on an event queue with a simulated clock."""

from __future__ import annotations

import collections
import heapq
import random
from dataclasses import dataclass

from slurm_elastic.core import rates
from slurm_elastic.core.cordons import CordonBook
from slurm_elastic.core.lifecycle import Worker, WorkerState, transition
from slurm_elastic.core.placement import Allocation
from slurm_elastic.core.reconcile import ReconcileConfig
from slurm_elastic.core.scaling import Autoscaler
from slurm_elastic.core.staleness import AdmissionLeases, StalenessManager, is_untrainable
from slurm_elastic.core.tick import ControlState, TickConfig
from slurm_elastic.sim.policies import PolicySeat, make_policy
from slurm_elastic.sim.results import Sample, ScaleEvent
from slurm_elastic.sim.trace import Trace

S = WorkerState
NODE = "sim"  # the one simulated node


@dataclass
class _Proc:
    """A running worker step as the simulated machine sees it."""

    worker_id: str
    slot: int
    launched_s: float
    phase: str = "starting"  # starting | warmup | admit | rollout | submit | exited
    registered: bool = False
    drain: bool = False
    granted: int = 0
    version: int = 0  # policy version the rollout in flight started from
    busy_s: float = 0.0  # seconds spent generating, rollouts finished
    rollout_since_s: float | None = None  # the rollout in flight started then
    busy_reported_s: float = 0.0  # what the last heartbeat reported
    epoch: int = 0  # bumps on every phase change: stale events are ignored


class SimulatedWorkload:
    """The simulated machine and trainer of one run (its state and event queue); the controller
    that ticks on it is :class:`~slurm_elastic.sim.engine.Simulation`."""

    def __init__(self, trace: Trace, policy: str = "ours", seed: int | None = None) -> None:
        self.trace, self.policy_name = trace, policy
        self.seed = trace.seed if seed is None else seed
        self.seat = PolicySeat(make_policy(policy, trace))
        self.rollout_rng = random.Random(self.seed * 7919 + 1)
        self.trainer_rng = random.Random(self.seed * 7919 + 2)
        self.failure_rng = random.Random(self.seed * 7919 + 3)
        q, c = trace.queue, trace.cluster
        self.tick_cfg = TickConfig(ReconcileConfig(c.drain_timeout_s, c.heartbeat_grace_s,
                                                   backoff_base_s=c.backoff_base_s, backoff_max_s=c.backoff_max_s))
        self.allocations = (Allocation(0, {NODE: tuple(range(c.gpu_slots))}),)
        self.state = ControlState(Autoscaler(trace.autoscaler), CordonBook(), policy=self.seat)
        self.staleness = StalenessManager(q.batch_size, q.max_staleness, q.max_concurrent)
        self.now_s = 0.0
        self._events: list[tuple[float, int, str, str, int]] = []
        self._seq = 0
        self.records: dict[str, Worker] = self.state.workers
        self.procs: dict[str, _Proc] = {}
        self.buffer: collections.deque[tuple[int, int]] = collections.deque()  # (version, n_seqs)
        self.queued_seqs = 0
        self.grants = AdmissionLeases(self.staleness, self.trace.queue.admission_ttl_s)
        self.pulls = rates.WindowRate(rates.CONSUMPTION_WINDOW_S)
        self.accepts = rates.WindowRate(rates.PRODUCTION_WINDOW_S)
        self.group_sizes = rates.GroupSizes()
        self.busy = rates.WindowRate(rates.PRODUCTION_WINDOW_S)  # busy worker-seconds reported by heartbeats
        self.trainer_steps = rates.TrainerSteps()
        self.admit_waiters: list[str] = []
        self.submit_waiters: list[str] = []
        self.trainer_waiting_since: float | None = None
        self.trainer_busy = False
        self.version = 0
        self.counters: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.max_staleness = 0
        self.samples: list[Sample] = []
        self.scale_events: list[ScaleEvent] = []

    def _at(self, t_s: float, kind: str, worker_id: str = "", epoch: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t_s, self._seq, kind, worker_id, epoch))

    # ---- worker steps ------------------------------------------------------------------------
    def _launch(self, worker_id: str) -> None:
        used = {p.slot for p in self.procs.values()}
        free = [s for s in range(self.trace.cluster.gpu_slots) if s not in used]
        cordoned = self.state.cordons.cordoned()
        slot = next((s for s in free if (NODE, s) not in cordoned), free[0])
        proc = _Proc(worker_id, slot, self.now_s)
        self.procs[worker_id] = proc
        self.counters["launches"] += 1
        self._at(self.now_s + self.trace.cluster.startup_s, "register", worker_id, proc.epoch)

    def _set_phase(self, proc: _Proc, phase: str) -> None:
        proc.phase, proc.epoch = phase, proc.epoch + 1

    def _worker_event(self, proc: _Proc, kind: str) -> None:
        if kind == "register":
            proc.registered = True
            record = self.records.get(proc.worker_id)
            if record is not None and record.state is S.STARTING:
                record.node, record.gpus, record.last_heartbeat_s = NODE, (proc.slot,), self.now_s
                transition(record, S.ACTIVE, self.now_s, f"registered on slot {proc.slot}")
            if proc.drain or record is None or record.state is S.DRAINING:
                self._exit(proc)  # the registration answer says "drain"
                return
            self._set_phase(proc, "warmup")
            self._at(self.now_s + self.trace.cluster.warmup_s, "ready", proc.worker_id, proc.epoch)
        elif kind == "ready":
            self._try_admit(proc)
        elif kind == "rollout_done":
            if proc.rollout_since_s is not None:
                proc.busy_s += self.now_s - proc.rollout_since_s
                proc.rollout_since_s = None
            self._try_submit(proc)

    def _drain(self, proc: _Proc) -> None:
        proc.drain = True
        if proc.phase == "admit":  # the admission wait ends on a drain
            self._exit(proc)

    def _exit(self, proc: _Proc, killed: bool = False) -> None:
        if killed and proc.phase in ("rollout", "submit"):
            self.counters["lost"] += self.trace.queue.group_size
        self.counters["gpu_s"] += self.now_s - proc.launched_s
        self._set_phase(proc, "exited")
        del self.procs[proc.worker_id]
        for waiters in (self.admit_waiters, self.submit_waiters):
            if proc.worker_id in waiters:
                waiters.remove(proc.worker_id)

    def _try_admit(self, proc: _Proc) -> bool:
        """The SDK's admit loop; False when the staleness gate says wait."""
        if proc.drain:
            self._exit(proc)
            return True
        group = self.trace.queue.group_size
        self.group_sizes.asked(group - proc.granted)
        proc.granted += self.grants.grant(proc.worker_id, group - proc.granted, self.now_s)
        if proc.granted < group:
            self._wait(proc, "admit", self.admit_waiters)
            return False
        self._stop_waiting(proc, self.admit_waiters)
        proc.granted, proc.version, proc.rollout_since_s = 0, self.version, self.now_s
        self._set_phase(proc, "rollout")
        trace = self.trace
        duration_s = (trace.rollout.sample_s(self.rollout_rng) * trace.phase_at(self.now_s).rollout_scale
                      * trace.slowdown_at(proc.slot, self.now_s))
        self._at(self.now_s + duration_s, "rollout_done", proc.worker_id, proc.epoch)
        return True

    def _wait(self, proc: _Proc, phase: str, waiters: list[str]) -> None:
        """Park ``proc`` in ``phase`` (once) until the gate it waits at opens."""
        if proc.phase != phase:
            self._set_phase(proc, phase)
            waiters.append(proc.worker_id)

    @staticmethod
    def _stop_waiting(proc: _Proc, waiters: list[str]) -> None:
        if proc.worker_id in waiters:
            waiters.remove(proc.worker_id)

    def _serve_admissions(self) -> None:
        for worker_id in list(self.admit_waiters):
            if self.staleness.capacity() <= 0:
                return
            self._try_admit(self.procs[worker_id])

    def _try_submit(self, proc: _Proc) -> bool:
        group = self.trace.queue.group_size
        if self.queued_seqs + group > self.trace.queue.capacity_seqs:
            self._wait(proc, "submit", self.submit_waiters)
            return False
        self._stop_waiting(proc, self.submit_waiters)
        self.buffer.append((proc.version, group))
        self.queued_seqs += group
        self.grants.accept(proc.worker_id, group, self.now_s)
        self.accepts.add(self.now_s, group)
        self.group_sizes.add(group)
        self.counters["generated"] += group
        self.records[proc.worker_id].rollouts += 1
        if self.trainer_waiting_since is not None:
            self._trainer_try_pull()
        if proc.drain:
            self._exit(proc)
        else:
            self._try_admit(proc)
        return True

    def _fail(self, n_workers: int) -> None:
        running = sorted(w for w, p in self.procs.items() if p.registered and not p.drain)
        for worker_id in self.failure_rng.sample(running, min(n_workers, len(running))):
            self.counters["failures"] += 1
            self.records[worker_id].exit_code = 1  # its wrapper reports the command's failure as the step ends
            self._exit(self.procs[worker_id], killed=True)

    # ---- the trainer -------------------------------------------------------------------------
    def _trainer_try_pull(self) -> None:
        if self.trainer_busy:
            return
        q = self.trace.queue
        if self._drop_untrainable():
            self._serve_admissions()
        if self.queued_seqs < q.batch_size:
            if self.trainer_waiting_since is None:
                self.trainer_waiting_since = self.now_s
            return
        need = q.batch_size
        while need > 0:
            version, n_seqs = self.buffer.popleft()
            self.max_staleness = max(self.max_staleness, self.version - version)
            need -= n_seqs
        self.queued_seqs -= q.batch_size
        self.counters["consumed"] += q.batch_size
        self.pulls.add(self.now_s, q.batch_size)
        self.trainer_steps.served(self.now_s, self.counters["steps"])  # (the batch: the step it makes)
        if self.trainer_waiting_since is not None:
            self.counters["trainer_idle_s"] += self.now_s - self.trainer_waiting_since
            self.trainer_waiting_since = None
        self.trainer_busy = True
        jitter = self.trace.trainer.step_jitter
        scale = self.trace.phase_at(self.now_s).trainer_scale * (1 + jitter * (2 * self.trainer_rng.random() - 1))
        self._at(self.now_s + self.trace.trainer.step_s * max(0.01, scale), "trainer_done")
        for worker_id in list(self.submit_waiters):
            if not self._try_submit(self.procs[worker_id]):
                break

    def _drop_untrainable(self) -> int:
        """Drop every group the trainer cannot train on, wherever it sits (the queue's rule, at the
        pull as there); returns the sequences dropped."""
        max_staleness = self.trace.queue.max_staleness
        dropped = sum(n for version, n in self.buffer if is_untrainable(version, self.version, max_staleness))
        if dropped:
            self.buffer = collections.deque(g for g in self.buffer
                                            if not is_untrainable(g[0], self.version, max_staleness))
            self.queued_seqs -= dropped
            self.counters["dropped"] += dropped
            self.staleness.on_dropped(dropped)
        return dropped

    def _trainer_done(self) -> None:
        self.trainer_busy = False
        self.trainer_steps.acked(self.now_s, self.counters["steps"])
        self.trainer_steps.asked(self.now_s)
        self.version += 1
        self.counters["steps"] += 1
        self.staleness.on_version(self.version)
        self._serve_admissions()
        self._trainer_try_pull()
