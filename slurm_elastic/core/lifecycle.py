"""A worker's life as one table of allowed state changes, with a timestamped history.

    STARTING -> ACTIVE -> DRAINING -> INACTIVE, plus FAILED and BACKOFF (crash-loop backoff), and
    SUSPENDED (its burst job is suspended: its step is stopped, not ended) back to where it was.

Anything not in :data:`TRANSITIONS` is refused with :class:`TransitionError`.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from slurm_elastic.errors import TransitionError


class WorkerState(str, enum.Enum):
    STARTING = "STARTING"  # step launched (or about to be), not yet registered
    ACTIVE = "ACTIVE"  # registered and heart-beating: counted as capacity
    DRAINING = "DRAINING"  # drain signal sent: finishing its rollout, never counted, never re-drained
    INACTIVE = "INACTIVE"  # step ended after a drain (or a clean exit): terminal
    FAILED = "FAILED"  # step ended unexpectedly or stopped heart-beating
    BACKOFF = "BACKOFF"  # waiting out crash-loop backoff before a relaunch
    SUSPENDED = "SUSPENDED"  # its burst job is suspended: its step stopped, its admissions kept; never counted


S = WorkerState
TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    S.STARTING: frozenset({S.ACTIVE, S.DRAINING, S.FAILED, S.INACTIVE, S.SUSPENDED}),
    S.ACTIVE: frozenset({S.DRAINING, S.FAILED, S.INACTIVE, S.SUSPENDED}),
    S.DRAINING: frozenset({S.INACTIVE, S.FAILED, S.SUSPENDED}),
    S.FAILED: frozenset({S.BACKOFF, S.INACTIVE}),
    S.BACKOFF: frozenset({S.STARTING, S.INACTIVE}),
    S.SUSPENDED: frozenset({S.STARTING, S.ACTIVE, S.DRAINING, S.INACTIVE}),  # back as it was, or its job ended
    S.INACTIVE: frozenset(),
}
_THROUGH = {S.DRAINING: "begin_drain", S.SUSPENDED: "suspend"}  # states entered only through these
HISTORY_LIMIT = 50


@dataclass
class Worker:
    """The controller's record of one worker (one Slurm step at a time)."""

    worker_id: str
    state: WorkerState = WorkerState.STARTING
    job_id: int = 0  # the Slurm job whose allocation holds its step; 0: the controller's own job
    step_id: str = ""  # Slurm step id once seen, e.g. "3"
    node: str = ""  # where its rank 0 runs (and its endpoint listens)
    gpus: tuple[int, ...] = ()  # on ``node``, as Slurm numbers them there (SLURM_STEP_GPUS)
    nodes: tuple[str, ...] = ()  # every node of its step as Slurm lists it; () or (node,): one node
    node_gpus: dict[str, tuple[int, ...]] = field(default_factory=dict)  # GPUs on its other nodes, as their ranks report
    launched_at_s: float = 0.0
    last_heartbeat_s: float = 0.0
    drain_started_s: float = 0.0
    backoff_until_s: float = 0.0
    crash_count: int = 0
    launches: int = 0
    placeholder: bool = False  # holds a cordoned GPU so Slurm cannot hand it out; never capacity
    busy: bool = False  # a rollout in flight (from heartbeats), for choosing whom to drain
    rollouts: int = 0  # finished by its current step, from heartbeats
    busy_s: float = 0.0  # its current step's seconds inside rollouts (the one in flight included), from heartbeats
    paused_busy_s: float = 0.0  # of busy_s, seconds its job was stopped (suspended) inside a rollout: not its speed
    stood_s: float = 0.0  # seconds its step stood SUSPENDED with its burst job (the current step's)
    endpoint: str = ""
    kill_sent_s: float = 0.0
    failure_reason: str = ""  # set when the controller kills it for cause (e.g. lost heartbeat)
    exit_code: int | None = None  # reported by the worker wrapper as it exits
    terminated_by_signal: bool = False  # and it got a SIGTERM or SIGINT before that exit
    gpu_blameless: bool = False  # its step's end says nothing of its GPUs (a server not ready in time)
    vanished_at_s: float = 0.0  # its step left the listing with no exit reported; 0: listed (or handled)
    drain_signaled: bool = False  # servers: the drain signal waits until nothing is in flight
    drained_by_its_step: bool = False  # the drain signal reached its step from outside (an operator, Slurm)
    liveness_failures: int = 0  # servers: failed liveness probes in a row, as the wrapper reports them
    weights_version: int | None = None  # servers: the published weights version it runs (None: its own)
    suspended_from: str = ""  # SUSPENDED: the state it comes back to when its job runs again
    suspended_at_s: float = 0.0  # SUSPENDED: since when
    history: list[tuple[float, str, str, str]] = field(default_factory=list)

    @property
    def counts_as_capacity(self) -> bool:
        """STARTING, ACTIVE, BACKOFF and a kill-for-cause (both end in a relaunch) fill a slot.

        A worker draining for scale-down never does, and neither does a placeholder.
        """
        if self.placeholder:
            return False
        return self.state in (S.STARTING, S.ACTIVE, S.BACKOFF) or (
            self.state is S.DRAINING and bool(self.failure_reason)
        )

    @property
    def has_step(self) -> bool:
        """Its step runs (a SUSPENDED worker's is stopped: it holds no slot of a running job)."""
        return self.state in (S.STARTING, S.ACTIVE, S.DRAINING)

    @property
    def keeps_step(self) -> bool:
        """Its step exists: it runs, or stands stopped with its suspended job (it may heart-beat the
        moment the job resumes, before a tick has seen it)."""
        return self.has_step or self.state is S.SUSPENDED

    @property
    def all_nodes(self) -> tuple[str, ...]:
        """Every node its step runs on, rank 0's first."""
        rest = tuple(n for n in self.nodes if n != self.node)
        return ((self.node,) if self.node else ()) + rest

    @property
    def gpu_keys(self) -> tuple[tuple[str, int], ...]:
        """Every (node, GPU) it is known to hold: rank 0's and those its other ranks reported."""
        keys = tuple((self.node, g) for g in self.gpus)
        return keys + tuple((n, g) for n, gpus in self.node_gpus.items() if n != self.node for g in gpus)

    def cordoned_gpus(self, cordoned: Collection[tuple[str, int]]) -> list[tuple[str, int]]:
        """The cordoned GPUs that concern it: its own, and on another node of its step whose rank
        has not reported its GPUs yet, any GPU of that node."""
        if not cordoned:  # the usual case, asked several times a tick for every worker
            return []
        unknown = set(self.all_nodes) - {self.node, *self.node_gpus}
        mine = set(self.gpu_keys)
        return sorted(k for k in cordoned if k in mine or k[0] in unknown)

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["state"] = self.state.value
        data["gpus"] = list(self.gpus)
        data["nodes"] = list(self.nodes)
        data["node_gpus"] = {n: list(g) for n, g in self.node_gpus.items()}
        data["history"] = [list(h) for h in self.history]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Worker:
        known = set(cls.__dataclass_fields__)
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["state"] = WorkerState(kwargs.get("state", "STARTING"))
        kwargs["gpus"] = tuple(int(g) for g in kwargs.get("gpus", ()))
        kwargs["nodes"] = tuple(str(n) for n in kwargs.get("nodes", ()))
        kwargs["node_gpus"] = {str(n): tuple(int(g) for g in gs) for n, gs in kwargs.get("node_gpus", {}).items()}
        kwargs["history"] = [tuple(h) for h in kwargs.get("history", [])]
        return cls(**kwargs)


def commands_ended(workers: Iterable[Worker], launched_ids: Collection[str]) -> list[str]:
    """Ids under which no worker command runs any more: the step ended (FAILED, BACKOFF,
    INACTIVE), holds only a GPU (a placeholder), or is being replaced by a new step
    (``launched_ids``). What the queue granted under them will never be submitted under them.
    A SUSPENDED worker's command is stopped, not ended: resumed, it submits what it was granted."""
    return [w.worker_id for w in workers
            if w.state in (S.FAILED, S.BACKOFF, S.INACTIVE) or w.placeholder or w.worker_id in launched_ids]


def commands_stopped(workers: Iterable[Worker]) -> list[str]:
    """Ids whose command stands stopped with its suspended job: what the queue granted them stays
    counted in flight (the staleness bound holds whether the job resumes or ends)."""
    return [w.worker_id for w in workers if w.state is S.SUSPENDED]


def drained_by_signal_reason(signal_name: str | None) -> str:
    """Why a worker drains whose step got a drain signal from outside, by the signal its wrapper
    saw first: SIGTERM drains only a burst job's worker (an operator's scancel, a preemption's
    grace time, its job's time limit, a requeue: Slurm sends each its steps); any other is the configured drain signal (scancel --signal, Slurm's --signal)."""
    if signal_name == "SIGTERM":
        return ("the drain signal reached its step (SIGTERM: an operator's scancel, a preemption's grace time, "
                "its job's time limit or a requeue)")
    if signal_name:
        return f"the drain signal reached its step ({signal_name}: scancel --signal, or Slurm's --signal)"
    return "the drain signal reached its step (scancel --signal, or Slurm's)"


def begin_drain(worker: Worker, now_s: float, reason: str, *, failure_reason: str = "") -> None:
    """The one way into DRAINING: the drain clock starts now. ``failure_reason`` marks a kill for
    cause (it keeps the worker's slot counted, so a replacement follows its exit)."""
    if worker.state is S.SUSPENDED:
        raise TransitionError(f"worker {worker.worker_id}: SUSPENDED is left through resume")
    if failure_reason:
        worker.failure_reason = failure_reason
    worker.drain_started_s = now_s
    _enter(worker, WorkerState.DRAINING, now_s, reason)


def suspend(worker: Worker, now_s: float, reason: str) -> None:
    """The one way into SUSPENDED: its job (a burst job) is suspended with its step, which is
    stopped, not ended; :func:`resume` brings it back to the state it was in."""
    if worker.state is S.SUSPENDED:
        return
    from_state = worker.state
    _enter(worker, S.SUSPENDED, now_s, reason)
    worker.suspended_from, worker.suspended_at_s = from_state.value, now_s
    worker.vanished_at_s = 0.0  # a stamp from a listing before the suspension is not the resumed job's


def resume(worker: Worker, now_s: float, reason: str) -> float:
    """The one way out of SUSPENDED but to INACTIVE: back to the state it was suspended in. Its
    heartbeat, start and drain clocks move on by the time it stood still (never past ``now_s``);
    returns that time."""
    stopped_s = max(0.0, now_s - worker.suspended_at_s)
    back = WorkerState(worker.suspended_from)
    _enter(worker, back, now_s, reason)
    worker.last_heartbeat_s = min(now_s, worker.last_heartbeat_s + stopped_s)
    if back is S.STARTING:
        worker.launched_at_s = min(now_s, worker.launched_at_s + stopped_s)
    elif back is S.DRAINING:
        worker.drain_started_s = min(now_s, worker.drain_started_s + stopped_s)
    worker.suspended_from, worker.suspended_at_s, worker.vanished_at_s = "", 0.0, 0.0
    worker.stood_s += stopped_s
    return stopped_s


def stood_total_s(worker: Worker, now_s: float) -> float:
    """Seconds its current step has stood stopped with its suspended burst job, up to ``now_s``
    (a suspension not resumed from yet included): read at two heartbeats, the difference is how long
    it could not run in between."""
    if worker.state is S.SUSPENDED:
        return worker.stood_s + max(0.0, now_s - worker.suspended_at_s)
    return worker.stood_s


def transition(worker: Worker, to: WorkerState, now_s: float, reason: str) -> None:
    """Move ``worker`` to ``to`` if the table allows it, recording when and why (DRAINING only
    through :func:`begin_drain`, into SUSPENDED only through :func:`suspend`, out of it only
    through :func:`resume` or to INACTIVE)."""
    if to in _THROUGH and to in TRANSITIONS[worker.state]:
        raise TransitionError(f"worker {worker.worker_id}: {to.value} is entered through {_THROUGH[to]}")
    if worker.state is S.SUSPENDED and to is not S.INACTIVE and to in TRANSITIONS[worker.state]:
        raise TransitionError(f"worker {worker.worker_id}: SUSPENDED is left through resume")
    _enter(worker, to, now_s, reason)


def _enter(worker: Worker, to: WorkerState, now_s: float, reason: str) -> None:
    if to not in TRANSITIONS[worker.state]:
        raise TransitionError(f"worker {worker.worker_id}: {worker.state.value} -> {to.value} is not allowed")
    worker.history.append((now_s, worker.state.value, to.value, reason))
    del worker.history[:-HISTORY_LIMIT]
    worker.state = to
