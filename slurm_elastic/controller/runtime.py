"""The controller's loop: observe Slurm (one batched listing), run the pure core's tick, execute
its actions, persist. Errors of an action are kept and shown in status; the loop never dies on
a bad tick. The API handlers are in controller/control_plane.py (the operator's commands in
controller/operator_commands.py), the views in controller/views.py, the reads of the job's
nodes, time limit and comment in controller/allocation_checks.py, the records and their
persistence in controller/base.py."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, get_args

from slurm_elastic.controller.allocation_checks import AllocationChecks
from slurm_elastic.controller.base import STATE_REFRESH_S
from slurm_elastic.controller.batched_saves import BatchedSaves
from slurm_elastic.controller.control_plane import UnknownWorkerError
from slurm_elastic.controller.operator_commands import OperatorCommands
from slurm_elastic.controller.pause_watch import PauseWatch
from slurm_elastic.controller.step_specs import foreign_gpus_by_node
from slurm_elastic.controller.views import StatusViews
from slurm_elastic.core.cordons import CordonChange, CordonSource
from slurm_elastic.core.lifecycle import WorkerState, commands_ended, commands_stopped
from slurm_elastic.core.naming import AGENT_PREFIX, worker_id_of_step, worker_step_name
from slurm_elastic.core.placement import Allocation
from slurm_elastic.core.reconcile import EXITED_CLEANLY, Crashed, Launch, ObservedStep, Resumed
from slurm_elastic.core.scaling import PressureInputs
from slurm_elastic.core.tick import Observation, TickResult, autoscaler_inputs, autoscales, tick
from slurm_elastic.errors import SlurmElasticError
from slurm_elastic.slurm.launchers import running_step_launches
from slurm_elastic.slurm.parse import StepInfo
from slurm_elastic.slurm.runner import killed_since_spawned

__all__ = ["STATE_REFRESH_S", "Controller", "UnknownWorkerError", "foreign_gpus_by_node"]
log = logging.getLogger(__name__)
NOT_SLURM_CORDONS: tuple[CordonSource, ...] = tuple(s for s in get_args(CordonSource) if s != "slurm")  # ours alone
_TASK_FAILED = re.compile(r"task \d+: (Exited with exit code [1-9]|Killed|Terminated|Aborted|Segmentation fault|"
                          r"Out Of Memory)")  # srun's line for a task that failed, or died by a signal
_STEP_ABORTED = "Job step aborted"  # srun's line when Slurm ends the step (scancel), before it sees a task end
OUTPUT_TAIL_BYTES = 4096  # of a step's output, read for Slurm's CANCELLED line


def step_output_says_cancelled(path: Path, step: str) -> bool:
    """Whether the end of a step's output holds slurmstepd's ``*** STEP {step} ON ... CANCELLED``."""
    return any(f"*** STEP {step} ON " in line and " CANCELLED AT " in line for line in _tail_lines(path))


def srun_log_says_terminated(path: Path, step: str) -> bool:
    """Whether the end of the step's srun log holds srun's ``_step_signal: Terminating StepId={step}``:
    srun's own record that Slurm cancelled the step, written even where slurmstepd's line in the
    step's output is not (a step cancelled while it was starting). Not when the line before it is
    a task's failure (``task N: Exited with exit code M``, M > 0, or ``task N: Killed``: the
    wrapper killed on its node) with no ``Job step aborted`` just before it: srun ending the step
    because a task ended by itself, a crash whose exit code the wrapper could not report. A
    ``scancel`` of the step reads ``Job step aborted``, then the task's ``Killed``, then this line."""
    pattern = re.compile(rf"Terminating StepId={re.escape(step)}(?![0-9])")
    lines = _tail_lines(path)

    def cancelled(i: int) -> bool:
        aborted = any(_STEP_ABORTED in line for line in lines[max(0, i - 2):i])
        return aborted or not (i and _TASK_FAILED.search(lines[i - 1]))
    return any(pattern.search(line) and cancelled(i) for i, line in enumerate(lines))



def _tail_lines(path: Path) -> list[str]:
    try:
        with path.open("rb") as out:
            out.seek(max(0, out.seek(0, os.SEEK_END) - OUTPUT_TAIL_BYTES))
            return out.read().decode(errors="replace").splitlines()
    except OSError:
        return []


class Controller(OperatorCommands, StatusViews, AllocationChecks):
    """One job's controller. Thread-safe: the API calls in while the loop ticks."""

    def observe(self, burst_job_ids: tuple[int, ...] = ()) -> list[StepInfo] | None:
        """One batched listing of the steps of the job (and of its running burst jobs); None (and
        an error kept) if Slurm did not answer."""
        try:
            if burst_job_ids:
                return self.backend.list_steps_of((self.job_id, *burst_job_ids))
            return self.backend.list_steps(self.job_id)
        except SlurmElasticError as exc:
            self._record_error("observe", str(exc))
            return None

    def observe_burst(self) -> dict[int, dict[str, tuple[int, ...]]]:
        """The running burst jobs and their GPUs (one ``squeue``; the last view if Slurm did not answer)."""
        if self.burst is None:
            return {}
        self.burst.observe()
        return self.burst.running_gpus()

    def burst_allocations(self, running: dict[int, dict[str, tuple[int, ...]]]) -> tuple[Allocation, ...]:
        """The job's own allocation, then each running burst job not being given back."""
        releasing = self.burst.releasing if self.burst is not None else frozenset()
        return self.allocations + tuple(Allocation(job_id, gpus) for job_id, gpus in sorted(running.items())
                                        if job_id not in releasing)

    def observation(self, steps: list[StepInfo] | None, now_s: float, *, with_queue: bool = True,
                    running_burst: dict[int, dict[str, tuple[int, ...]]] | None = None,
                    paused_s: float = 0.0) -> Observation:
        """What the core decides on: the listing, the queue's numbers (when the autoscaler reads
        them), busy workers and the routers' load; burst jobs being given back, and the slots more
        burst jobs could add."""
        snapshot = self.queue.snapshot() if with_queue and self.queue is not None else None
        jobs = (self.job_id, *(running_burst or {}))
        releasing = frozenset(running_burst or {}) & self.burst.releasing if self.burst is not None else frozenset()
        possible = 0
        if self.burst is not None:
            held = len(running_burst or {}) - len(releasing) + self.burst.jobs_on_hold
            possible = max(0, self.burst.policy.max_jobs - held) * self.burst.policy.worker_slots_per_job
        return Observation(
            steps=None if steps is None else tuple(
                ObservedStep(wid, st.step_id, st.nodes[0] if st.nodes else "", st.job_id, st.nodes)
                for st in steps if (wid := worker_id_of_step(st.name)) is not None),
            agent_nodes=frozenset() if steps is None else frozenset(
                (st.job_id, st.name.removeprefix(AGENT_PREFIX)) for st in steps if st.name.startswith(AGENT_PREFIX)),
            foreign_gpus={} if steps is None else {
                job: foreign_gpus_by_node([st for st in steps if st.job_id == job]) for job in jobs},
            releasing_jobs=releasing,
            stopped_jobs=self.burst.suspended if self.burst is not None else frozenset(),
            alive_jobs=self.burst.alive if self.burst is not None else frozenset(),  # none: no burst job runs
            burst_slots_possible=possible,
            queue=snapshot,
            busy_worker_s=self.busy_worker_s(now_s) if snapshot else None,
            outstanding_by_worker=self.outstanding_of_draining(now_s),
            total_outstanding=self.endpoints.total_outstanding(now_s) if self.is_server else None,
            paused_s=paused_s,
            cancelled_worker_ids=frozenset() if steps is None else self.cancelled_worker_ids(steps),
            launches_never_ran=frozenset() if steps is None else self.launches_never_ran(steps),
            time_left_s=None if self.job_times_s is None else self.job_times_s[1] - time.time(),
            run_span_s=None if self.job_times_s is None else self.job_times_s[1] - self.job_times_s[0],
        )

    def launches_never_ran(self, steps: list[StepInfo]) -> frozenset[str]:
        """Of the launches an earlier controller saved (checked once, at the first listing): those
        with no step listed and no ``srun`` for them on this host, where every launch's ``srun``
        runs (it was killed between saving a launch and running it). Empty if the host's processes
        cannot be read: those launches then wait ``start_timeout_s`` as any other."""
        unconfirmed, self.unconfirmed_launches = self.unconfirmed_launches, set()
        running = running_step_launches() if unconfirmed else None
        if running is None:
            return frozenset()
        listed = {worker_id_of_step(st.name) for st in steps}
        return frozenset(
            wid for wid in unconfirmed
            if (w := self.state.workers.get(wid)) is not None and w.state is WorkerState.STARTING and not w.step_id
            and wid not in listed and (w.job_id or self.job_id, worker_step_name(wid)) not in running)

    def cancelled_worker_ids(self, steps: list[StepInfo]) -> frozenset[str]:
        """Workers whose step left the listing because someone cancelled it: slurmstepd wrote
        ``*** STEP J.S ON node CANCELLED AT ... ***`` to the step's output (or srun logged
        ``Terminating StepId=J.S``, where that line did not come; or the step's srun was killed by
        a signal: its shepherd then cancels the step, and the reaper says so in srun's log), and
        the wrapper reported no exit code (``scancel J.S`` kills it outright) or the exit that
        followed a SIGTERM (``scancel --signal=TERM J.S``). A step srun ends because one of its
        tasks failed gets the same line, and srun's SIGTERM to the other tasks looks like an
        operator's; the failed task says so first (rank 0 in its exit, another task through
        :meth:`_rank_failed`, which sets ``failure_reason``), so that end counts as a crash."""
        listed = {worker_id_of_step(st.name) for st in steps}
        return frozenset(
            w.worker_id for w in self.state.workers.values()
            if w.step_id and w.has_step and w.worker_id not in listed and not w.failure_reason
            and (w.exit_code is None or w.terminated_by_signal)
            and self._says_cancelled(w.worker_id, f"{w.job_id or self.job_id}.{w.step_id}"))

    def _says_cancelled(self, worker_id: str, step: str) -> bool:
        logs = self.state_dir / "logs"
        return (step_output_says_cancelled(logs / f"worker-{worker_id}.out", step)
                or srun_log_says_terminated(logs / "srun" / f"{worker_id}.log", step)
                or killed_since_spawned(logs / "srun" / f"{worker_id}.log") is not None)

    def tick(self) -> TickResult:
        """Observe, decide, act, persist. Never raises for Slurm trouble."""
        if (self.allocation_check_due
                or self.clock() - self.allocation_checked_s >= self.config.controller.allocation_check_s):
            self.check_allocation(self.clock())
        running_burst = self.observe_burst()
        steps = self.observe(tuple(sorted(running_burst)))
        with self.lock:
            paused_s = self.pause_watch.take() if self.pause_watch is not None else 0.0
            if paused_s > 0:
                self.move_busy_clocks_on(paused_s)
            now_s = self.clock()
            self.ticks += 1
            obs = self.observation(steps, now_s, with_queue=autoscales(self.state), running_burst=running_burst,
                                   paused_s=paused_s)
            self.forget_ended()
            result = tick(obs, self.state, self.tick_config, self.burst_allocations(running_burst), now_s)
            self.usable_slots = sum(result.slots_once_heard) + obs.burst_slots_possible + result.kept_outside_slots
            if "error" in self.state.last_decision:
                log.error("the autoscaler failed, the worker count holds: %s", self.state.last_decision["error"])
            if any(w.vanished_at_s == now_s for w in self.state.workers.values()):
                self.allocation_check_due = True  # a step ended unasked: a node failure ends every step on it
            for event in result.events:
                if isinstance(event, Crashed):
                    self.allocation_check_due = True  # a node failure ends every step on the node
                    where = f" on {event.node} {list(event.gpus)}" if event.node else ""  # (never placed: none)
                    log.warning("worker %s %s%s: %s", event.worker_id,
                                "crashed" if event.counted else "ended (not counted against its GPU)", where,
                                event.reason)
                elif isinstance(event, Resumed):
                    log.warning("worker %s: its burst job %d runs again after %.0f s suspended; it goes on with "
                                "its step and its admissions", event.worker_id, event.job_id, event.stopped_s)
                elif isinstance(event, CordonChange):
                    log.warning("cordoned %s:%d: %s", event.node, event.gpu, event.reason)
                elif event.for_status:
                    self.note_state(event.message)
                else:
                    log.warning("%s", event.message)
            self._release_leases(result)
            if result.actions:  # write-ahead: a controller killed while it launches, signals or cancels
                self._save_ahead()  # leaves records its successor waits for, drains on, or counts as its own kills
            self._publish_endpoints()  # routers drop the servers this tick drains or cancels before they hear it
        # outside the lock: workers register and heart-beat while a large scale-up spawns its sruns (192 took
        # 23 s on a loaded 2-core host, and held every registration and heartbeat that long)
        self._run_all(result.actions)
        with self.lock:
            self._publish_endpoints()
            self.pace_heartbeats()
            self.save()
            burst_inputs = (self.burst_inputs(result, running_burst, now_s)
                            if self.burst is not None and steps is not None else None)
        if burst_inputs is not None and self.burst is not None and self.burst.listed_now:  # sbatch/scancel outside the lock
            self.burst.step(**burst_inputs)
            self.save()  # what it submitted or gave back, for a successor killed before the next tick
        return result

    def _save_ahead(self) -> None:
        """The write-ahead save of a tick's actions; if it fails they run all the same (a
        successor adopts their steps from Slurm's listing). Before, the tick stopped there: its
        launches stayed STARTING with no srun until ``start_timeout_s``, then counted as crashes."""
        try:
            self.save()
        except OSError as exc:
            log.error("could not save the state before this tick's actions (%s); running them all the same", exc)

    def _release_leases(self, result: TickResult) -> None:
        """Release the queue's admissions held under ids whose command ended or is relaunched
        now (before the launch: a new step starts with none); hold those of commands that stand
        stopped with their suspended burst job, or go on after it (they submit under them)."""
        if self.queue is None:
            return
        launched = {a.worker_id for a in result.actions if isinstance(a, Launch)}
        released = self.queue.release_leases(commands_ended(self.state.workers.values(), launched))
        if released:
            log.info("released %d admitted sequences held under worker ids whose command ended", released)
        self.queue.hold_leases(commands_stopped(self.state.workers.values()))

    def burst_inputs(self, result: TickResult, running_burst: dict[int, dict[str, tuple[int, ...]]],
                     now_s: float) -> dict[str, Any]:
        """What the burst decision needs from this tick: the target, the own allocation's slots,
        the pool's live and draining workers in each job."""
        live: Counter[int] = Counter()
        draining: Counter[int] = Counter()
        ending: set[int] = set()
        recent_s = now_s - 3 * self.config.controller.tick_interval_s
        for worker in self.state.workers.values():
            if worker.state is WorkerState.DRAINING:
                draining[worker.job_id] += 1
            elif worker.state in (WorkerState.STARTING, WorkerState.ACTIVE):
                live[worker.job_id] += 1
            elif (worker.state is WorkerState.INACTIVE and worker.job_id != self.job_id and worker.history
                  and worker.history[-1][0] >= recent_s and worker.history[-1][3] == EXITED_CLEANLY):
                ending.add(worker.job_id)  # left a burst job unasked: Slurm signalled its end
            if worker.job_id != self.job_id and worker.drained_by_its_step and (
                    worker.state is WorkerState.DRAINING
                    or (worker.state is WorkerState.INACTIVE and worker.history and worker.history[-1][0] >= recent_s)):
                ending.add(worker.job_id)  # the drain signal reached it from outside: Slurm's (a preemption, the
                # limit); also when its step ended within the tick that saw it DRAINING (a quick drain)
        slurm_cordoned = self.state.cordons.cordoned_by("slurm")
        ours = set().union(*(self.state.cordons.cordoned_by(s) for s in NOT_SLURM_CORDONS))

        def every_gpu(gpus_by_node: dict[str, tuple[int, ...]], among: set[tuple[str, int]]) -> bool:
            return bool(gpus_by_node) and all((n, g) in among for n, gpus in gpus_by_node.items() for g in gpus)

        out_of_use = frozenset(  # Slurm's marks judged only by node states read while the job held its nodes
            job_id for job_id, gpus_by_node in running_burst.items()
            if (job_id in self.node_states_read_for and every_gpu(gpus_by_node, slurm_cordoned))
            or (every_gpu(gpus_by_node, ours) and not live[job_id]))
        for gpus_by_node in running_burst.values():
            self.burst_node_gpus.update((n, gpus) for n, gpus in gpus_by_node.items() if gpus)
        exclude = tuple(sorted(n for n, gpus in self.burst_node_gpus.items()  # a new burst job would get them again
                               if all((n, g) in ours for g in gpus)))  # (Slurm keeps its drained nodes out itself)
        return {"target_workers": result.desired, "ending_jobs": frozenset(ending),  # 0 before the job's time limit
                "out_of_use_jobs": out_of_use, "exclude_nodes": exclude,
                "allocation_slots": result.slots_once_heard[0] if result.slots_once_heard else 0,
                "workers_by_job": dict(live), "draining_by_job": dict(draining), "now_s": now_s}

    def pressure_inputs(self, allowed_slots: int, now_s: float) -> PressureInputs:
        """What the autoscaler would see now."""
        with self.lock:
            return autoscaler_inputs(self.state, self.observation(None, now_s), allowed_slots, self.tick_config)

    def run_forever(self, stop: threading.Event) -> None:
        """Tick every ``tick_interval_s``, and at once after a request that changes the target
        (:meth:`wake_loop`), until ``stop`` or :attr:`stop_requested` is set."""
        interval_s = self.config.controller.tick_interval_s

        def wake_on_stop() -> None:
            stop.wait()
            self._wake.set()

        threading.Thread(target=wake_on_stop, name="stop-wakes-loop", daemon=True).start()
        self.pause_watch = PauseWatch()
        self.pause_watch.start()
        saves = self.batched_saves = BatchedSaves(self._save_behind)
        saves.start()
        try:
            self._loop(stop, interval_s)
        finally:
            self.batched_saves = None  # a registration from now on saves at once
            saves.stop()
            self.pause_watch.stop()

    def _loop(self, stop: threading.Event, interval_s: float) -> None:
        while not (stop.is_set() or self.stop_requested.is_set()):
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
                self.tick_total_count += 1
            self._wake.wait(max(0.0, interval_s - (time.monotonic() - started)))
