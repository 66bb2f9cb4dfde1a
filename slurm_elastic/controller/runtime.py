"""The controller's run time: the reconcile loop around the pure core, and the API's control plane.

Each tick observes Slurm with one batched call, asks the autoscaler (or the operator's manual
target) for a worker count, reconciles, and runs the resulting actions. Errors of an action
are kept and shown in status; the loop never dies on a bad tick.
"""

from __future__ import annotations

import json
import logging
import re
import statistics
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from slurm_elastic.controller.config import ElasticConfig
from slurm_elastic.controller.state import StateFile
from slurm_elastic.controller.worker_env import worker_settings_env
from slurm_elastic.core.cordons import CordonBook
from slurm_elastic.core.endpoints import Endpoint, EndpointBook
from slurm_elastic.core.health import AgentReport
from slurm_elastic.core.lifecycle import Worker, WorkerState, transition
from slurm_elastic.core.liveness import drain_not_live
from slurm_elastic.core.naming import AGENT_PREFIX, worker_id_of_step, worker_step_name
from slurm_elastic.core.pressure import QueueFeed, pressure_inputs
from slurm_elastic.core.rates import WindowRate
from slurm_elastic.core.reconcile import (
    Cancel,
    Drain,
    Launch,
    ObservedStep,
    Plan,
    ReconcileConfig,
    reconcile,
)
from slurm_elastic.core.registration import registration_refusal
from slurm_elastic.core.scaling import Autoscaler, AutoscalerConfig, PressureInputs
from slurm_elastic.errors import SlurmElasticError
from slurm_elastic.slurm.backend import SlurmBackend, StepSpec
from slurm_elastic.slurm.parse import StepInfo

log = logging.getLogger(__name__)
S = WorkerState
ERROR_LIMIT = 20
TICK_WINDOW = 60  # recent tick durations kept for status and /metrics
AGENT_RELAUNCH_S = 30.0
SIGNAL_FANOUT = 8  # scancel calls in flight at once in one tick
# worker fields that every heartbeat refreshes: a change in them alone does not rewrite the state
# file at once (after a restart they are refreshed by the next heartbeat; the liveness clock is reset)
LIVE_WORKER_FIELDS = frozenset({"last_heartbeat_s", "busy", "rollouts"})
STATE_REFRESH_S = 30.0  # live fields alone are written at most this often


class UnknownWorkerError(KeyError):
    """A request named a worker id the controller does not know."""


class Controller:
    """One job's controller. Thread-safe: the API calls in while the loop ticks."""

    def __init__(
        self,
        config: ElasticConfig,
        job_id: int,
        backend: SlurmBackend,
        state_dir: Path,
        *,
        gpus_by_node: dict[str, tuple[int, ...]],
        controller_url: str = "",
        token_file: Path | None = None,
        clock: Callable[[], float] = time.time,
        queue: QueueFeed | None = None,
    ) -> None:
        self.config = config
        self.job_id = job_id
        self.backend = backend
        self.state_dir = state_dir
        self.gpus_by_node = gpus_by_node  # the job's GPU indexes on each of its nodes
        self.controller_url = controller_url
        self.token_file = token_file
        self.clock = clock
        self.lock = threading.RLock()
        w = config.workers
        self.reconcile_config = ReconcileConfig(
            drain_timeout_s=w.drain_timeout_s, heartbeat_grace_s=w.heartbeat_grace_s,
            start_timeout_s=w.start_timeout_s, backoff_base_s=w.backoff_base_s, backoff_max_s=w.backoff_max_s,
            liveness_failure_threshold=w.liveness_failure_threshold if w.kind == "server" else 0,
        )
        self.workers: dict[str, Worker] = {}
        self.next_number = 1
        self.target_workers = max(0, w.initial_workers)
        self.manual_target: int | None = None
        self.paused = False
        self.wake_all_active = False
        self.health_rules = config.health.rules()
        self.cordons = CordonBook(self.health_rules)
        self.agent_launched_s: dict[str, float] = {}
        self.foreign_gpus: dict[str, int] = {}  # GPUs held by the job's other steps (e.g. the trainer)
        self.listed_worker_ids: frozenset[str] = frozenset()  # worker steps in Slurm's latest listing
        # versions keep increasing across controller restarts, so a router never mistakes a new
        # controller's set for the one it already has
        self.endpoints = EndpointBook(version=int(clock() * 1000))
        self.is_server = config.workers.kind == "server"
        self.autoscaler = Autoscaler(AutoscalerConfig.from_mapping(config.autoscaler))
        if w.initial_workers < 0:
            self.target_workers = self.autoscaler.config.min_workers
        self.queue = queue  # the rollout queue's numbers, for the autoscaler and the status (None: no queue)
        self.last_decision: dict[str, Any] = {"action": "hold", "reason": "starting"}
        self.errors: list[dict[str, Any]] = []
        self._errors_lock = threading.Lock()
        self.ticks = 0
        self._wake = threading.Event()  # set by requests that change the target: the loop ticks at once
        self.tick_durations_s: deque[float] = deque(maxlen=TICK_WINDOW)
        self.tick_total_s = 0.0
        self.heartbeats = 0
        self.busy_meter = WindowRate()  # worker-seconds spent generating, from heartbeats' busy_s
        self._busy_s_seen: dict[str, float] = {}  # each worker's last reported busy_s
        self._busy_lock = threading.Lock()  # heartbeats add while a tick reads
        self.started_at_s = clock()
        self.state_notes: list[str] = []  # what loading the job's saved state could not keep, and why
        self.state_file = StateFile(state_dir / "state.json", job_id)
        self._saved_durable = ""  # the last written state without live fields, as JSON
        self._saved_at_s = float("-inf")  # time.monotonic() of the last write
        self._load_state()

    # ---- persistence -----------------------------------------------------------------------
    def _load_state(self) -> None:
        restored = self.state_file.load()
        for note in restored.notes:
            self.note_state(note)
        self.workers = restored.workers
        self.next_number = restored.next_number or self.next_number
        self.target_workers = self.target_workers if restored.target_workers is None else restored.target_workers
        self.manual_target, self.paused, self.wake_all_active = (restored.manual_target, restored.paused,
                                                                 restored.wake_all_active)
        # no saved state or no saved target (first start, a bad file): the first listing seeds it
        self._seed_target_from_slurm = not restored.found or restored.target_workers is None
        if restored.autoscaler is not None:  # both validated when read
            self.autoscaler = Autoscaler.from_state(self.autoscaler.config, restored.autoscaler)
        if restored.cordons is not None:
            self.cordons = CordonBook.from_state(restored.cordons, self.health_rules)
        now_s = self.clock()
        for worker in self.workers.values():  # nobody could heart-beat while no controller ran
            if worker.has_step:
                worker.last_heartbeat_s = max(worker.last_heartbeat_s, now_s)
                if worker.state is S.STARTING:
                    worker.launched_at_s = max(worker.launched_at_s, now_s)
        if restored.found:
            log.info("restored state: %d worker records, target %d", len(self.workers), self.target_workers)

    def note_state(self, note: str) -> None:
        """Something about the job's saved state an operator should know: logged, kept for status."""
        log.error("%s", note)
        self.state_notes.append(note)
        self._record_error("state", note)

    def _state(self) -> dict[str, Any]:
        live = {k: w.to_json() for k, w in self.workers.items() if w.state is not S.INACTIVE or
                self.clock() - (w.history[-1][0] if w.history else 0) < 3600}
        return {
            "workers": live, "next_number": self.next_number, "target_workers": self.target_workers,
            "manual_target": self.manual_target, "paused": self.paused, "wake_all_active": self.wake_all_active,
            "cordons": self.cordons.to_state(),
            "autoscaler": self.autoscaler.to_state(),
        }

    def save(self) -> None:
        """Write the state file if its durable content changed, or live fields are STATE_REFRESH_S old.

        A steady pool then costs no write per tick; heartbeats alone do not rewrite the file.
        """
        with self.lock:
            state = self._state()
            durable = json.dumps({**state, "workers": {k: {f: v for f, v in w.items() if f not in LIVE_WORKER_FIELDS}
                                                       for k, w in state["workers"].items()}}, sort_keys=True)
            if durable == self._saved_durable and time.monotonic() - self._saved_at_s < STATE_REFRESH_S:
                return
            self.state_file.save(state)
            self._saved_durable, self._saved_at_s = durable, time.monotonic()

    # ---- the loop ----------------------------------------------------------------------------
    def observe(self) -> list[StepInfo] | None:
        """One batched listing of the job's steps; None (and an error kept) if Slurm did not answer."""
        try:
            return self.backend.list_steps(self.job_id)
        except SlurmElasticError as exc:
            self._record_error("observe", str(exc))
            return None

    def tick(self) -> Plan:
        """Observe, decide, act, persist. Never raises for Slurm trouble."""
        steps = self.observe()
        observed = None if steps is None else [
            ObservedStep(wid, st.step_id, st.nodes[0] if st.nodes else "")
            for st in steps if (wid := worker_id_of_step(st.name)) is not None
        ]
        with self.lock:
            now_s = self.clock()
            self.ticks += 1
            self.cordons.tick(now_s)
            health_drains = self._drain_unhealthy(now_s)
            cordoned = self.cordoned_gpus()
            if steps is not None and observed is not None:
                self.foreign_gpus = foreign_gpus_by_node(steps)
                self.listed_worker_ids = frozenset(o.worker_id for o in observed)
            if observed is not None and self._seed_target_from_slurm:
                self._seed_target(len(observed))
            allowed_slots, exclude = self.placement(cordoned, self.unknown_nodes(now_s))
            desired = self.desired_workers(allowed_slots, now_s)
            plan = reconcile(self.workers, observed, desired, allowed_slots, exclude, frozenset(cordoned),
                             self.reconcile_config, now_s, self.next_number)
            self.next_number = plan.next_number
            for crash in plan.crashes:
                self.on_crash(crash.worker_id, crash.node, crash.gpus, crash.reason, now_s)
            self._run_all([*health_drains, *plan.actions, *self._server_drains_due(now_s)])
            if steps is not None:
                self._ensure_agents(steps, now_s)
            self._publish_endpoints()
            self.save()
        return plan

    def _seed_target(self, running: int) -> None:
        """Without saved state, keep the worker steps that already run: never tear down a live fleet."""
        self._seed_target_from_slurm = False
        if running > self.target_workers:
            log.warning("no saved state: keeping the %d worker steps Slurm runs (target was %d)",
                        running, self.target_workers)
            self.target_workers = running

    def _server_drains_due(self, now_s: float) -> list[Drain]:
        """Servers leave discovery first; the drain signal follows once nothing is in flight there."""
        due = []
        grace_s = self.config.workers.server_drain_grace_s
        for worker in self.workers.values():
            if (self.is_server and worker.state is S.DRAINING and worker.step_id and not worker.drain_signaled
                    and not worker.placeholder and now_s - worker.drain_started_s >= grace_s
                    and self.endpoints.outstanding(worker.worker_id, now_s) == 0):
                due.append(Drain(worker.worker_id, worker.step_id))
        return due

    def _publish_endpoints(self) -> None:
        """The routable set: ACTIVE server workers with an endpoint (never draining or placeholders)."""
        self.endpoints.publish([
            Endpoint(w.worker_id, w.endpoint, w.node, w.gpus) for w in self.workers.values()
            if w.state is S.ACTIVE and w.endpoint and not w.placeholder
        ])

    def _drain_unhealthy(self, now_s: float) -> list[Drain]:
        """Drain workers on GPUs that became unhealthy (if the rules say drain). Level-triggered."""
        targets = self.cordons.drain_targets()
        drains = []
        for worker in self.workers.values():
            hit = [g for g in worker.gpus if (worker.node, g) in targets]
            if hit and worker.state in (S.ACTIVE, S.STARTING) and not worker.placeholder:
                entry = self.cordons.cordoned().get((worker.node, hit[0]))
                worker.drain_started_s = now_s
                transition(worker, S.DRAINING, now_s,
                           f"GPU {worker.node}:{hit[0]} unhealthy: {entry.reason if entry else 'cordoned'}")
                if worker.step_id:
                    drains.append(Drain(worker.worker_id, worker.step_id))
        return drains

    def unknown_nodes(self, now_s: float) -> set[str]:
        """Nodes whose agent has not been heard recently (no new workers there); none without agents."""
        if not self.config.agent.enabled:
            return set()
        return self.cordons.unknown_nodes(now_s, nodes=self.gpus_by_node.keys())

    def _ensure_agents(self, steps: list[StepInfo], now_s: float) -> None:
        """One agent step per node (``srun --overlap``, all of the node's GPUs); relaunch a vanished one."""
        if not self.config.agent.enabled:
            return
        running = {st.name.removeprefix(AGENT_PREFIX) for st in steps if st.name.startswith(AGENT_PREFIX)}
        for node, gpus in self.gpus_by_node.items():
            if node in running or now_s - self.agent_launched_s.get(node, -1e9) < AGENT_RELAUNCH_S:
                continue
            self.agent_launched_s[node] = now_s
            try:
                self.backend.launch_step(self.agent_spec(node, len(gpus)),
                                         self.state_dir / "logs" / "srun" / f"agent-{node}.log")
            except SlurmElasticError as exc:
                self._record_error("agent", f"{node}: {exc}")

    def agent_spec(self, node: str, gpu_count: int) -> StepSpec:
        a = self.config.agent
        argv = [sys.executable, "-m", "slurm_elastic", "agent", "--controller-url", self.controller_url,
                "--source", a.source, "--interval-s", str(a.interval_s), "--node", node]
        if self.token_file is not None:
            argv += ["--token-file", str(self.token_file)]
        if a.source != "nvml":  # the drill file; where NVML works, "auto" never reads it
            argv += ["--inject-file", a.inject_file or str(self.state_dir / "drill.toml"), "--gpus", str(gpu_count)]
        return StepSpec(job_id=self.job_id, name=f"{AGENT_PREFIX}{node}", argv=tuple(argv),
                        output_path=self.state_dir / "logs" / f"agent-{node}.out", gpus=gpu_count,
                        nodelist=(node,), overlap=True)

    def _run_all(self, actions: list[Launch | Drain | Cancel]) -> None:
        """Launches return at once (detached srun); signals and cancels wait for scancel, so a
        large scale-down sends them side by side rather than one after another in the tick."""
        waits = [a for a in actions if not isinstance(a, Launch)]
        for action in actions:
            if isinstance(action, Launch):
                self._run(action)
        if len(waits) <= 1:
            for action in waits:
                self._run(action)
            return
        with ThreadPoolExecutor(max_workers=min(SIGNAL_FANOUT, len(waits)), thread_name_prefix="signal") as pool:
            list(pool.map(self._run, waits))

    def _run(self, action: Launch | Drain | Cancel) -> None:
        worker = self.workers[action.worker_id]
        try:
            if isinstance(action, Launch):
                self.backend.launch_step(self.step_spec(worker.worker_id, action.exclude_nodes),
                                         self.state_dir / "logs" / "srun" / f"{worker.worker_id}.log")
            elif isinstance(action, Drain):
                if self.is_server and not worker.drain_signaled and not self._drain_due(worker):
                    return  # out of discovery now; the signal follows when nothing is in flight
                worker.drain_signaled = True
                self.backend.signal_step(self.job_id, action.step_id, self.config.workers.drain_signal)
            else:
                log.info("cancelling worker %s (step %s): %s", action.worker_id, action.step_id, action.reason)
                self.backend.cancel_step(self.job_id, action.step_id)
        except SlurmElasticError as exc:
            self._record_error(type(action).__name__.lower(), f"worker {action.worker_id}: {exc}")

    def _drain_due(self, worker: Worker) -> bool:
        now_s = self.clock()
        return (now_s - worker.drain_started_s >= self.config.workers.server_drain_grace_s
                and self.endpoints.outstanding(worker.worker_id, now_s) == 0)

    def run_forever(self, stop: threading.Event) -> None:
        """Tick every ``tick_interval_s``, and at once after a request that changes the target
        (:meth:`wake_loop`), until ``stop`` is set."""
        interval_s = self.config.controller.tick_interval_s

        def wake_on_stop() -> None:
            stop.wait()
            self._wake.set()

        threading.Thread(target=wake_on_stop, name="stop-wakes-loop", daemon=True).start()
        while not stop.is_set():
            self._wake.clear()
            started = time.monotonic()
            try:
                self.tick()
            except Exception as exc:  # the loop never dies on one bad tick
                log.exception("tick failed")
                self._record_error("tick", f"{type(exc).__name__}: {exc}")
            with self.lock:
                self.tick_durations_s.append(time.monotonic() - started)
                self.tick_total_s += self.tick_durations_s[-1]
            self._wake.wait(max(0.0, interval_s - (time.monotonic() - started)))

    def wake_loop(self) -> None:
        """Run the next tick now rather than at the interval (a new target is acted on at once)."""
        self._wake.set()

    # ---- decisions ---------------------------------------------------------------------------
    def cordoned_gpus(self) -> dict[tuple[str, int], dict[str, Any]]:
        """Every cordoned GPU with why, since when, and who cordoned it (operator, health, crash, preflight)."""
        return {key: entry.to_dict() for key, entry in self.cordons.cordoned().items()}

    def placement(self, cordoned: dict[tuple[str, int], dict[str, Any]],
                  unknown_nodes: set[str] | frozenset[str] = frozenset()) -> tuple[int, tuple[str, ...]]:
        """(worker slots on usable GPUs, nodes to --exclude) for this tick."""
        per_worker = self.config.workers.gpus_per_worker
        if per_worker == 0:  # CPU-only workers: GPU slots do not bound them
            return 1_000_000, ()
        slots, exclude = 0, []
        for node, gpus in self.gpus_by_node.items():
            usable = [] if node in unknown_nodes else [g for g in gpus if (node, g) not in cordoned]
            usable = usable[: max(0, len(usable) - self.foreign_gpus.get(node, 0))]
            if len(usable) < per_worker:
                exclude.append(node)  # every GPU there is cordoned (or too few are left)
            slots += len(usable) // per_worker
        return slots, tuple(exclude)

    def desired_workers(self, allowed_slots: int, now_s: float) -> int:
        """wake-all, else the operator's target, else (unless paused) the autoscaler's decision."""
        if self.wake_all_active:
            self.target_workers = allowed_slots
            self.last_decision = {"action": "hold", "reason": f"wake-all: every allowed GPU ({allowed_slots})"}
        elif self.manual_target is not None:
            self.target_workers = self.manual_target
            self.last_decision = {"action": "hold", "reason": f"manual target {self.manual_target} (autoscaler paused)"}
        elif self.paused:
            self.last_decision = {"action": "hold", "reason": f"autoscaler paused at {self.target_workers}"}
        elif not self.autoscaler.config.enabled:
            self.last_decision = {"action": "hold", "reason": "autoscaler disabled (enable_elastic = false)"}
        else:
            decision = self.autoscaler.decide(self.pressure_inputs(allowed_slots, now_s), now_s)
            self.target_workers = decision.target_workers
            self.last_decision = decision.to_dict()
        return self.target_workers

    def pressure_inputs(self, allowed_slots: int, now_s: float) -> PressureInputs:
        """What the autoscaler sees: the queue's numbers, server load, workers by state."""
        counts = Counter(w.state for w in self.workers.values() if not w.placeholder)
        snapshot = self.queue.snapshot() if self.queue is not None else None
        return pressure_inputs(snapshot, counts, self.busy_workers(now_s) if snapshot else None, allowed_slots,
                               self.endpoints.total_outstanding(now_s) if self.is_server else None)

    def on_crash(self, worker_id: str, node: str, gpus: tuple[int, ...], reason: str, now_s: float) -> None:
        """A worker died on (node, gpus): counted per GPU; repeated crashes cordon it."""
        log.warning("worker %s crashed on %s %s: %s", worker_id, node, list(gpus), reason)
        for gpu in gpus:
            for change in self.cordons.record_crash(node, gpu, now_s):
                log.warning("cordoned %s:%d: %s", change.node, change.gpu, change.reason)

    # ---- the control plane (called from the API) ---------------------------------------------
    def register_worker(self, worker_id: str, info: dict[str, Any]) -> dict[str, Any]:
        """A worker step says where it landed: ``run`` or ``hold`` (a cordoned GPU); UnknownWorkerError
        (nothing recorded) for an id this controller did not launch."""
        with self.lock:
            now_s = self.clock()
            worker = self.workers.get(worker_id)
            if refusal := registration_refusal(worker_id, worker, self.listed_worker_ids):
                raise UnknownWorkerError(refusal)
            if worker is None or worker.state in (S.INACTIVE, S.FAILED, S.BACKOFF):
                worker = Worker(worker_id=worker_id, launched_at_s=now_s)
                worker.history.append((now_s, "", S.STARTING.value, "registered without a record: adopted"))
                self.workers[worker_id] = worker
            worker.node = str(info.get("node", worker.node))
            worker.gpus = tuple(int(g) for g in info.get("gpus", worker.gpus))
            worker.step_id = str(info.get("step_id", worker.step_id) or worker.step_id)
            worker.endpoint = str(info.get("endpoint", worker.endpoint) or "")
            worker.last_heartbeat_s = now_s
            need_mb = self.config.workers.gpu_memory_mb
            if need_mb and worker.state is S.STARTING:
                for gpu in worker.gpus:
                    ok, why = self.cordons.preflight_ok(worker.node, gpu, need_mb)
                    if not ok:
                        self.cordons.record_preflight_failure(worker.node, gpu, need_mb, why, now_s)
            cordoned = self.cordoned_gpus()
            hit = [g for g in worker.gpus if (worker.node, g) in cordoned]
            ready = bool(info.get("ready", True))
            if worker.state is S.STARTING and (hit or ready):
                worker.placeholder = bool(hit)
                where = f"{worker.node} GPU {list(worker.gpus)}"
                reason = (f"landed on cordoned GPU {worker.node}:{hit[0]}: holding it as a placeholder" if hit
                          else f"ready at {worker.endpoint} on {where}" if worker.endpoint
                          else f"registered on {where}")
                transition(worker, S.ACTIVE, now_s, reason)
            self._publish_endpoints()
            self.save()
            action = "hold" if worker.placeholder else ("drain" if worker.state is S.DRAINING else "run")
            return {"worker_id": worker_id, "action": action,
                    "heartbeat_interval_s": self.config.workers.heartbeat_interval_s}

    def heartbeat(self, worker_id: str, info: dict[str, Any]) -> dict[str, Any]:
        """Liveness (and busy/rollout counts) from a worker; answers whether it should drain."""
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is None or not worker.has_step:
                raise UnknownWorkerError(worker_id)
            worker.last_heartbeat_s = self.clock()
            self.heartbeats += 1
            if "busy" in info:
                worker.busy = bool(info["busy"])
            if "rollouts" in info:
                worker.rollouts = int(info["rollouts"])
            if "busy_s" in info:
                self._record_busy_s(worker_id, float(info["busy_s"]))
            if info.get("exit_code") is not None:
                worker.exit_code = int(info["exit_code"])
            if "outstanding_requests" in info:
                worker.busy = int(info["outstanding_requests"]) > 0
            if "liveness_failures" in info:
                worker.liveness_failures = int(info["liveness_failures"])
                if drain_not_live([worker], self.reconcile_config.liveness_failure_threshold,
                                  worker.last_heartbeat_s):
                    self._publish_endpoints()  # out of discovery now; the tick sends the drain signal
            drain = worker.state is S.DRAINING and not worker.placeholder and (
                not self.is_server or worker.drain_signaled)
            # a record still STARTING (e.g. restored from before its registration was saved): ask again
            return {"drain": drain, "hold": worker.placeholder, "register": worker.state is S.STARTING}

    def _record_busy_s(self, worker_id: str, busy_s: float) -> None:
        """A worker's cumulative seconds inside rollouts: the increase goes into the busy meter."""
        with self._busy_lock:
            before = self._busy_s_seen.get(worker_id)
            self._busy_s_seen[worker_id] = busy_s
            if before is not None:  # the first report only sets where counting starts
                self.busy_meter.add(self.clock(), busy_s - before if busy_s >= before else busy_s)
            if len(self._busy_s_seen) > 2 * len(self.workers) + 16:
                self._busy_s_seen = {w: s for w, s in self._busy_s_seen.items() if w in self.workers}

    def busy_workers(self, now_s: float) -> float | None:
        """Workers generating on average over the window (busy worker-seconds per second); None
        while no worker reports busy time (an older SDK, or not the SDK)."""
        with self._busy_lock:
            return self.busy_meter.rate(now_s) if self._busy_s_seen else None

    def scale(self, n: int) -> dict[str, Any]:
        with self.lock:
            self.manual_target, self.wake_all_active, self.paused = max(0, int(n)), False, True
            self.save()
            self.wake_loop()
            return {"target_workers": self.manual_target, "paused": True}

    def pause(self) -> dict[str, Any]:
        with self.lock:
            self.paused = True
            self.save()
            return {"paused": True}

    def resume(self) -> dict[str, Any]:
        with self.lock:
            self.paused, self.manual_target, self.wake_all_active = False, None, False
            self.save()
            self.wake_loop()
            return {"paused": False}

    def wake_all(self) -> dict[str, Any]:
        with self.lock:
            self.wake_all_active, self.manual_target, self.paused = True, None, True
            self.save()
            self.wake_loop()
            return {"wake_all": True}

    def drain(self, worker_id: str) -> dict[str, Any]:
        """Drain one worker now (it is replaced if the target still asks for it)."""
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is None or not worker.has_step:
                raise UnknownWorkerError(worker_id)
            if worker.state is not S.DRAINING:
                worker.drain_started_s = self.clock()
                transition(worker, S.DRAINING, worker.drain_started_s, "drained by operator")
                self._publish_endpoints()
                if worker.step_id:
                    self._run(Drain(worker_id, worker.step_id))
            self.save()
            return {"worker_id": worker_id, "state": worker.state.value}

    def cordon(self, node: str, gpu: int, reason: str) -> dict[str, Any]:
        self._check_gpu(node, gpu)
        with self.lock:
            self.cordons.cordon_manual(node, gpu, reason or "cordoned by operator", self.clock())
            self.save()
            return {"node": node, "gpu": gpu, "cordoned": True}

    def uncordon(self, node: str, gpu: int) -> dict[str, Any]:
        self._check_gpu(node, gpu)
        with self.lock:
            self.cordons.uncordon_manual(node, gpu, self.clock())
            self.save()
            still = self.cordons.cordoned().get((node, gpu))
            return {"node": node, "gpu": gpu, "cordoned": still is not None,
                    "reason": still.reason if still else ""}

    def report_gpu_health(self, parsed: AgentReport) -> dict[str, Any]:
        """A node agent's telemetry (validated by the route)."""
        if parsed.node not in self.gpus_by_node:
            raise UnknownWorkerError(f"node {parsed.node} is not part of job {self.job_id}")
        with self.lock:
            changes = self.cordons.observe_report(parsed, self.clock())
            for change in changes:
                log.warning("%s %s:%d (%s): %s", change.action, change.node, change.gpu, change.source, change.reason)
            return {"node": parsed.node, "changes": [c.__dict__ for c in changes]}

    def _check_gpu(self, node: str, gpu: int) -> None:
        if gpu not in self.gpus_by_node.get(node, ()):
            raise UnknownWorkerError(f"{node}:{gpu} is not a GPU of job {self.job_id}")

    def endpoints_view(self) -> dict[str, Any]:
        """The routable servers (version, endpoints with their load) for discovery."""
        with self.lock:
            return self.endpoints.view(self.clock())

    def report_load(self, client_id: str, outstanding: dict[str, int], sent: int = 0, retried: int = 0,
                    failed: int = 0) -> dict[str, Any]:
        """A router's outstanding requests per worker; answers with the current version."""
        with self.lock:  # load on workers it does not know is not kept
            known = {w: n for w, n in outstanding.items() if w in self.workers}
            self.endpoints.report(client_id, known, self.clock(), sent, retried, failed)
            return {"version": self.endpoints.version}

    def status(self) -> dict[str, Any]:
        """Controller fields for /global-status and ``slurm-elastic status``, with the queue's numbers."""
        queue = self.queue.stats() if self.queue is not None else None  # outside our lock: the queue has its own
        with self.lock:
            now_s = self.clock()
            by_state = {s.value: 0 for s in WorkerState}
            for worker in self.workers.values():
                by_state[worker.state.value] += 1
            return {
                "job_id": self.job_id,
                "controller_url": self.controller_url,
                "now_s": round(now_s, 3),
                "uptime_s": round(now_s - self.started_at_s, 1),
                "ticks": self.ticks,
                "tick_duration_s": self.tick_duration_summary(),
                "heartbeats": self.heartbeats,
                "target_workers": self.target_workers,
                "paused": self.paused,
                "manual_target": self.manual_target,
                "wake_all": self.wake_all_active,
                "last_decision": self.last_decision,
                "workers_by_state": by_state,
                "placeholders": sum(1 for w in self.workers.values() if w.placeholder and w.has_step),
                "workers": [self._worker_view(w, now_s) for w in sorted(self.workers.values(), key=lambda w: w.worker_id)
                            if w.state is not S.INACTIVE],
                "cordoned_gpus": [{"node": n, "gpu": g, **v} for (n, g), v in sorted(self.cordoned_gpus().items())],
                "unknown_health_nodes": sorted(self.unknown_nodes(now_s)),
                "servers": self._servers_view(now_s) if self.is_server else None,
                "errors": self.errors[-ERROR_LIMIT:],
                "state_note": "; ".join(self.state_notes),
                "state_notes": list(self.state_notes),
                "queue": queue,
            }

    def tick_duration_summary(self) -> dict[str, float | int]:
        """Wall time of the last ``TICK_WINDOW`` ticks (observe + decide + act + persist): p50, p95, max,
        how many; and ``total_s``, the time of all ticks so far (a window's mean: delta total / delta ticks)."""
        recent = sorted(self.tick_durations_s)
        if not recent:
            return {"p50": 0.0, "p95": 0.0, "max": 0.0, "count": 0, "total_s": 0.0}
        p95 = recent[min(len(recent) - 1, round(0.95 * (len(recent) - 1)))]
        return {"p50": round(statistics.median(recent), 4), "p95": round(p95, 4), "max": round(recent[-1], 4),
                "count": len(recent), "total_s": round(self.tick_total_s, 4)}

    def _servers_view(self, now_s: float) -> dict[str, Any]:
        capacity = self.autoscaler.config.requests_per_worker_capacity
        view = self.endpoints.view(now_s)
        view["load_ratio"] = self.endpoints.load_ratio(capacity, now_s)
        view["requests_per_worker_capacity"] = capacity
        return view

    def _worker_view(self, worker: Worker, now_s: float) -> dict[str, Any]:
        return {
            "worker_id": worker.worker_id, "state": worker.state.value, "step_id": worker.step_id,
            "node": worker.node, "gpus": list(worker.gpus), "age_s": round(now_s - worker.launched_at_s, 1),
            "rollouts": worker.rollouts, "busy": worker.busy, "placeholder": worker.placeholder,
            "last_heartbeat_age_s": round(now_s - worker.last_heartbeat_s, 1), "crash_count": worker.crash_count,
            "launches": worker.launches, "endpoint": worker.endpoint, "liveness_failures": worker.liveness_failures,
            "outstanding_requests": self.endpoints.outstanding(worker.worker_id, now_s) if self.is_server else None,
            "history": [list(h) for h in worker.history[-10:]],
        }

    # ---- launching ---------------------------------------------------------------------------
    def step_spec(self, worker_id: str, exclude: tuple[str, ...]) -> StepSpec:
        w = self.config.workers
        values = {"worker_id": worker_id, "gpus": str(w.gpus_per_worker), "controller_url": self.controller_url,
                  "job_id": str(self.job_id), "state_dir": str(self.state_dir)}
        command = [_render(part, values) for part in w.command]
        env = {
            **w.env,
            "SLURM_ELASTIC_CONTROLLER_URL": self.controller_url,
            "SLURM_ELASTIC_WORKER_ID": worker_id,
            "SLURM_ELASTIC_STATE_DIR": str(self.state_dir),
            **worker_settings_env(w),
        }
        if self.token_file is not None:
            env["SLURM_ELASTIC_TOKEN_FILE"] = str(self.token_file)
        return StepSpec(
            job_id=self.job_id, name=worker_step_name(worker_id),
            argv=(sys.executable, "-m", "slurm_elastic", "worker", "--", *command),
            output_path=self.state_dir / "logs" / f"worker-{worker_id}.out",
            gpus=w.gpus_per_worker, cpus=w.cpus_per_worker, mem_mb=w.mem_per_worker_mb,
            exclude=exclude, env=env,
        )

    def _record_error(self, where: str, message: str) -> None:
        with self._errors_lock:  # also called from the tick's signal threads
            self._append_error(where, message)

    def _append_error(self, where: str, message: str) -> None:
        self.errors.append({"at_s": round(self.clock(), 3), "where": where, "error": message})
        del self.errors[:-ERROR_LIMIT]


def foreign_gpus_by_node(steps: list[StepInfo]) -> dict[str, int]:
    """GPUs that the job's own non-worker steps hold per node (the trainer's, say); agents overlap."""
    held: dict[str, int] = {}
    for step in steps:
        if worker_id_of_step(step.name) is not None or step.name.startswith(AGENT_PREFIX) or len(step.nodes) != 1:
            continue
        match = re.search(r"gres[:/]gpu(?::[^:,]+)?:(\d+)", step.tres_per_node)
        if match:
            held[step.nodes[0]] = held.get(step.nodes[0], 0) + int(match.group(1))
    return held


def _render(template: str, values: dict[str, str]) -> str:
    """Fill ``{name}`` placeholders we know; leave others (``{port}`` is filled on the node)."""
    out = template
    for key, value in values.items():
        out = out.replace("{" + key + "}", value)
    return out

