"""The controller's control plane: what the API calls (workers registering and heart-beating,
node agents' reports, routers' load); the operator's commands build on it in
controller/operator_commands.py."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from slurm_elastic.controller.base import ControllerBase
from slurm_elastic.controller.weights import latest_weights
from slurm_elastic.core.health import AgentReport
from slurm_elastic.core.lifecycle import (
    Worker,
    WorkerState,
    begin_drain,
    drained_by_signal_reason,
    stood_total_s,
)
from slurm_elastic.core.liveness import drain_not_live
from slurm_elastic.core.registration import CountsClaim, admit, counts_note, registration_refusal
from slurm_elastic.core.speed import note_busy_s

log = logging.getLogger(__name__)
S = WorkerState


class UnknownWorkerError(KeyError):
    """A request named a worker id the controller does not know."""


class ControlPlane(ControllerBase):
    """The API's handlers. Each takes the controller's lock and saves what it changed."""

    def check_lease_holder(self, worker_id: str) -> None:
        """UnknownWorkerError for an id that may not hold an admission lease: the rule of
        registration (a record with a live step, or a step of that name in Slurm's latest
        listing). Read without the lock (one dict and one set lookup): a lease asked for while a
        tick changes the record gets the answer of just before or just after it."""
        if refusal := registration_refusal(worker_id, self.state.workers.get(worker_id),
                                           self.state.listed_worker_ids):
            raise UnknownWorkerError(refusal)

    def register_worker(self, worker_id: str, info: dict[str, Any]) -> dict[str, Any]:
        """A worker step says where it landed: ``run`` or ``hold`` (a cordoned GPU); UnknownWorkerError
        (nothing recorded) for an id this controller did not launch."""
        with self.lock:
            now_s = self.clock()
            workers = self.state.workers
            worker = workers.get(worker_id)
            if refusal := registration_refusal(worker_id, worker, self.state.listed_worker_ids):
                raise UnknownWorkerError(refusal)
            if int(info.get("rank") or 0) > 0:
                return self._register_rank(worker_id, worker, info)
            if worker is None or worker.state in (S.INACTIVE, S.FAILED, S.BACKOFF):
                worker = Worker(worker_id=worker_id, launched_at_s=now_s)
                worker.history.append((now_s, "", S.STARTING.value, "registered without a record: adopted"))
                workers[worker_id] = worker
            node, gpus = str(info.get("node", worker.node)), tuple(int(g) for g in info.get("gpus", worker.gpus))
            running = worker.state in (S.ACTIVE, S.DRAINING) and bool(worker.node)
            if running and (node, gpus) != (worker.node, worker.gpus):
                log.warning("worker %s registered again on %s GPUs %s, but its step runs on %s GPUs %s (a step "
                            "does not move): kept", worker_id, node, list(gpus), worker.node, list(worker.gpus))
            elif not running:
                worker.node, worker.gpus = node, gpus
            if not (running and worker.step_id):  # a running step keeps its id
                worker.step_id = str(info.get("step_id", worker.step_id) or worker.step_id)
            endpoint = str(info.get("endpoint") or "")
            if endpoint or not running:  # a server registering again keeps its address unless it names one
                worker.endpoint = endpoint
            if worker.state is S.STARTING:  # the published weights version the server started with
                worker.weights_version = info.get("weights_version")
            worker.last_heartbeat_s = now_s
            # the step's first registration, before its command starts (not a server that became ready, nor a
            # registration asked again after a restart: its command holds GPU memory and has counted busy time)
            starts = worker.state is S.STARTING and not info.get("command_started")
            if starts and worker.launched_at_s >= self.started_at_s:
                self._count_busy_from_zero(worker_id)
            cordons = self.state.cordons
            need_mb = self.config.workers.gpu_memory_mb
            if need_mb and starts:
                for gpu in worker.gpus:
                    ok, why = cordons.preflight_ok(worker.node, gpu, need_mb)
                    if not ok:
                        cordons.record_preflight_failure(worker.node, gpu, need_mb, why, now_s)
            admit(worker, cordons.cordoned(), bool(info.get("ready", True)), now_s)
            self._publish_endpoints()
            self._save_soon()
            if self.weights_wake is not None and worker.endpoint:  # update it before it enters discovery
                self.weights_wake.set()
            action = "hold" if worker.placeholder else ("drain" if worker.state is S.DRAINING else "run")
            return {"worker_id": worker_id, "action": action, "weights": latest_weights(self.weights),
                    "heartbeat_interval_s": self.heartbeat_interval_s,
                    "server_drain_grace_s": self.config.workers.server_drain_grace_s}

    def _register_rank(self, worker_id: str, worker: Worker | None, info: dict[str, Any]) -> dict[str, Any]:
        """Another task of the worker's step (``workers.tasks_per_node`` above 1, or a multi-node
        step) says which node and GPUs it holds; it is not a worker of its own, and a task on the
        worker's own node adds no GPUs. Until the record exists (a restart adopts the step) it is
        asked to retry."""
        if worker is None or not worker.has_step:
            raise UnknownWorkerError(f"worker {worker_id}: no live record yet for its task {info.get('rank')}")
        node = str(info.get("node", ""))
        if self.shape.nodes <= 1 and node and worker.node and node != worker.node:  # its GPUs would be blamed
            raise UnknownWorkerError(f"worker {worker_id}: its step spans one node ({worker.node}); it has no "
                                     f"task {info.get('rank')} on {node}")
        if self.shape.nodes > 1 and node and node != worker.node:
            worker.node_gpus[node] = tuple(int(g) for g in info.get("gpus", ()))
            worker.nodes = worker.nodes if node in worker.nodes else (*worker.nodes, node)
            self._save_behind()  # at once: nobody asks a task's registration again after a restart
        action = "hold" if worker.placeholder else ("drain" if worker.state is S.DRAINING else "run")
        return {"worker_id": worker_id, "action": action, "weights": latest_weights(self.weights),
                "heartbeat_interval_s": self.heartbeat_interval_s}

    def heartbeat(self, worker_id: str, info: dict[str, Any]) -> dict[str, Any]:
        """Liveness (and busy/rollout counts) from a worker; answers whether it should drain."""
        with self.lock:
            worker = self.state.workers.get(worker_id)
            if worker is None or not worker.keeps_step:  # SUSPENDED: its job resumed before a tick saw it
                raise UnknownWorkerError(f"worker {worker_id}: no live worker of that id in job {self.job_id} "
                                         f"(`slurm-elastic status {self.job_id}` lists them)")
            if info.get("rank"):
                return self._rank_failed(worker, int(info["rank"]), info.get("exit_code"))
            note, other_step = self._counts_note(worker, info) if "instance" in info or "step" in info else ("", False)
            now_s = worker.last_heartbeat_s = self.clock()
            self.heartbeats += 1
            if note:  # the beat's counts are another process's: liveness only
                log.debug("worker %s: counts of instance %s not applied: %s", worker_id, info.get("instance"), note)
            else:
                if "busy" in info:
                    worker.busy = bool(info["busy"])
                if "rollouts" in info:
                    worker.rollouts = int(info["rollouts"])
                if "busy_s" in info:
                    self._note_busy_s(worker, float(info["busy_s"]), now_s)
                    self._record_busy_s(worker_id, float(info["busy_s"]), bool(info.get("busy")))
            if info.get("exit_code") is not None:
                worker.exit_code = int(info["exit_code"])
                worker.terminated_by_signal = bool(info.get("terminated_by_signal"))
            if info.get("cannot_start") and not worker.failure_reason:
                worker.failure_reason = (f"workers.command cannot start: {info['cannot_start']}; not counted "
                                         "against its GPU")
                worker.gpu_blameless = True
            if info.get("not_ready_after_s") is not None and not worker.failure_reason:
                worker.failure_reason = (f"server not ready after {float(info['not_ready_after_s']):g} s "
                                         "(workers.start_timeout_s): stopped by its wrapper; not counted against its GPU")
                worker.gpu_blameless = True
            if "outstanding_requests" in info:
                worker.busy = int(info["outstanding_requests"]) > 0
            if "liveness_failures" in info:
                worker.liveness_failures = int(info["liveness_failures"])
                if drain_not_live([worker], self.tick_config.reconcile.liveness_failure_threshold,
                                  worker.last_heartbeat_s):
                    self._publish_endpoints()  # out of discovery now; the tick sends the drain signal
            if info.get("leaving") and self._drained_by_its_step(worker, info.get("leaving_signal")) and self.is_server:
                self._publish_endpoints()  # routers drop it before its command hears the drain
            drain = worker.state is S.DRAINING and not worker.placeholder and (
                not self.is_server or (worker.drain_signaled and not worker.drained_by_its_step))
            # a record still STARTING (e.g. restored from before its registration was saved): ask again; never a
            # process of another step (its registration would hand the record to its step)
            reply: dict[str, Any] = {"drain": drain, "hold": worker.placeholder,
                     "register": worker.state is S.STARTING and not other_step,
                     "heartbeat_interval_s": self.heartbeat_interval_s}
            return (reply | {"counts_applied": False, "counts_note": note}) if note else reply

    def _counts_note(self, worker: Worker, info: dict[str, Any]) -> tuple[str, bool]:
        """Why this SDK beat's counts are not the worker's ('' if they are:
        :func:`~slurm_elastic.core.registration.counts_note`), and whether it came from a process of
        another step than the worker's. A beat whose counts apply takes the worker's claim (its
        closing beat lets go). The grace runs on a clock that stands still while the controller did
        not run (the pause watch) and while the worker's burst job stood suspended: nobody could
        beat then, so a pause hands no live holder's counts to another process."""
        instance, step = str(info.get("instance") or ""), str(info.get("step") or "")
        current = f"{worker.job_id or self.job_id}.{worker.step_id}" if worker.step_id else ""
        wall_s, lost_s = self.clock(), self.pause_watch.lost_total_s() if self.pause_watch is not None else 0.0
        now_s = wall_s - lost_s - stood_total_s(worker, wall_s)  # a clock that stands still in a pause
        claims, grace_s = self.counts_claims, self.config.workers.heartbeat_grace_s
        note = counts_note(worker.worker_id, claims.get(worker.worker_id), instance, step, current, now_s, grace_s)
        if not note and instance:
            claims[worker.worker_id] = CountsClaim("" if info.get("closing") else instance, step, now_s)
            if len(claims) > 2 * len(self.state.workers) + 16:
                self.counts_claims = {w: c for w, c in claims.items() if w in self.state.workers}
        return note, bool(step and current and step != current)

    def _drained_by_its_step(self, worker: Worker, signal_name: str | None = None) -> bool:
        """A worker's step got the drain signal from outside (``scancel --signal`` by an operator,
        Slurm's ``--signal`` before a burst job's end, a burst job's SIGTERM): it drains from now, as
        one this controller drained (its replacement may start; the drain timeout runs). A server's
        wrapper forwards the signal to its engine itself, after the routers' grace: the controller
        sends none. ``signal_name``: the signal its wrapper saw first, if it said. False if it was
        draining already (or holds GPUs as a placeholder)."""
        if worker.state not in (S.ACTIVE, S.STARTING) or worker.placeholder:
            return False
        begin_drain(worker, self.clock(), drained_by_signal_reason(signal_name))
        worker.drained_by_its_step = True
        worker.drain_signaled = self.is_server
        log.info("worker %s: the drain signal reached its step; draining%s", worker.worker_id,
                 ", out of discovery" if self.is_server else "")
        self._save_behind()
        return True

    def _rank_failed(self, worker: Worker, rank: int, exit_code: int | None) -> dict[str, Any]:
        """Another task of the worker's step says its command failed on its own (no SIGTERM, drain or
        interrupt came first): srun now ends the step, and its end is a crash of the worker, however
        rank 0 reports it."""
        if exit_code and not worker.failure_reason:
            worker.failure_reason = f"its task {rank} exited with code {exit_code}"
            log.warning("worker %s: %s; the step ends", worker.worker_id, worker.failure_reason)
            self._save_behind()
        return {"drain": False, "hold": False, "register": False}

    def _save_behind(self) -> None:
        """Save what already happened (a worker's own call, a drain signal sent); a failure is
        logged, not answered: the step runs whatever the file says, and the next tick saves again
        (a registration answered 503 while the state file could not be written ended its worker)."""
        try:
            self.save()
        except OSError as exc:
            log.error("could not save the state (%s); the next tick tries again", exc)

    def _save_soon(self) -> None:
        """A registration's save: written with the others of its burst within a second by the
        running loop's :class:`~slurm_elastic.controller.batched_saves.BatchedSaves`; at once
        without one (a controller driven tick by tick)."""
        saves = self.batched_saves  # read once: the loop's end sets it to None
        if saves is not None:
            saves.ask()
        else:
            self._save_behind()

    def _count_busy_from_zero(self, worker_id: str) -> None:
        """A step this controller launched registers: its SDK counts busy time from 0, all of it
        inside the production window, so its first report counts whole (taken as a baseline it
        would leave the first heartbeat interval out while its sequences count: the per-worker
        rate read several times too high in a job's first seconds)."""
        with self._busy_lock:
            self._busy_from_zero[worker_id] = self.clock()
            if len(self._busy_from_zero) > 2 * len(self.state.workers) + 16:
                self._busy_from_zero = {w: t for w, t in self._busy_from_zero.items() if w in self.state.workers}

    def _note_busy_s(self, worker: Worker, busy_s: float, now_s: float) -> None:
        """Its busy time for its speed (``seconds_per_rollout``): its SDK's clock ran on while the job
        was stopped, and a worker inside a rollout then read that much slower (after a 22 s
        suspend, 1.8 s a rollout against 1.0, and drained first as slow). The time the process was
        stopped since its last report comes from the pause watch, which counts a pause whether or
        not the tick has taken it: the first report after a resume may come before that tick; and,
        for a burst job's worker, from the time its job stood suspended (``stood_total_s``)."""
        lost_s = self.pause_watch.lost_total_s() if self.pause_watch is not None else 0.0
        lost_s += stood_total_s(worker, now_s)
        heard = self._busy_heard.get(worker.worker_id)
        self._busy_heard[worker.worker_id] = (now_s, lost_s)
        if heard is None:  # its first report here: nothing to measure against
            note_busy_s(worker, busy_s)
            return
        stopped_s = lost_s - heard[1]
        note_busy_s(worker, busy_s, now_s - heard[0] - stopped_s, stopped_s)
        if len(self._busy_heard) > 2 * len(self.state.workers) + 16:
            self._busy_heard = {w: h for w, h in self._busy_heard.items() if w in self.state.workers}

    def _record_busy_s(self, worker_id: str, busy_s: float, busy_now: bool = False) -> None:
        """A worker's cumulative seconds inside rollouts: the increase goes into the busy meter;
        whether it is inside one now carries its busy time on until its next report. The SDK runs
        one rollout at a time, so what is counted never runs ahead of the clock: from its previous
        report (or its registration) on, a worker is credited at most the time since and two
        heartbeat intervals, however many reports come (one report of 1e9 s, or 50,000 reports a
        few seconds apart, read as a per-worker production near 0, and the autoscaler asked for
        thousands of workers)."""
        with self._busy_lock:
            now_s = self.clock()
            previous = self._busy_since_report.get(worker_id)
            self._busy_since_report[worker_id] = (now_s, busy_now)
            before = self._busy_s_seen.get(worker_id)
            floor_s = previous[0] if previous is not None else now_s
            registered_s = self._busy_from_zero.pop(worker_id, None)
            if registered_s is not None:
                before, floor_s = 0.0, registered_s
            self._busy_s_seen[worker_id] = busy_s
            counted_to_s = max(self._busy_counted_to_s.get(worker_id, floor_s), floor_s)
            if before is not None:  # the first report of a step adopted after a restart sets where counting starts
                increase = busy_s - before if busy_s >= before else busy_s  # lower: its SDK counts from 0 again
                room_s = now_s + 2 * self.heartbeat_interval_s - counted_to_s
                increase = max(0.0, min(increase, room_s))
                counted_to_s += increase
                self.busy_meter.add(now_s, increase)
            self._busy_counted_to_s[worker_id] = counted_to_s
            if len(self._busy_s_seen) > 2 * len(self.state.workers) + 16:
                self._busy_s_seen = {w: s for w, s in self._busy_s_seen.items() if w in self.state.workers}
                self._busy_since_report = {w: r for w, r in self._busy_since_report.items() if w in self.state.workers}
                self._busy_counted_to_s = {w: t for w, t in self._busy_counted_to_s.items() if w in self.state.workers}

    def move_busy_clocks_on(self, paused_s: float) -> None:
        """The controller did not run for ``paused_s`` (a suspended job): workers were stopped too,
        and the busy time their SDK counted meanwhile is not credited (it read a worker's
        production as half of what it was after a 60 s suspend, and the autoscaler took every GPU).
        (Nor could an SDK beat: the claims on workers' counts measure their grace without the
        pause, from the pause watch itself.) Lock held."""
        with self._busy_lock:
            self._busy_counted_to_s = {w: t + paused_s for w, t in self._busy_counted_to_s.items()}
            self._busy_since_report = {w: (at_s + paused_s, busy) for w, (at_s, busy) in self._busy_since_report.items()}

    def busy_worker_s(self, now_s: float) -> float | None:
        """Worker-seconds inside rollouts over the production window: those reported, and since
        its last report, for a worker inside a rollout then, up to now (at most two heartbeat
        intervals: the sequences it makes count the moment they arrive, its busy time only at its
        next report). None while no worker reports busy time (an older SDK, or not the SDK)."""
        longest_s = 2 * self.heartbeat_interval_s
        with self._busy_lock:
            if not self._busy_s_seen:
                return None
            since_report_s = sum(min(longest_s, max(0.0, now_s - at_s))
                                 for at_s, busy in self._busy_since_report.values() if busy)
            return self.busy_meter.total(now_s) + since_report_s

    def report_gpu_health(self, parsed: AgentReport) -> dict[str, Any]:
        """A node agent's telemetry (validated by the route). Only the GPUs the job or its burst jobs
        hold on that node are taken in; the answer lists the indexes left out (an agent that sees the
        whole node)."""
        held = self._held_gpus(parsed.node)
        if not held:
            raise UnknownWorkerError(f"node {parsed.node} is not part of job {self.job_id} or its burst jobs")
        ignored = sorted({s.index for s in parsed.gpus if s.index not in held})
        if ignored:
            parsed = replace(parsed, gpus=[s for s in parsed.gpus if s.index in held])
        with self.lock:
            self._note_agent_errors(parsed.node, list(parsed.errors))
            self.state.cordons.keep_only(parsed.node, held)
            changes = self.state.cordons.observe_report(parsed, self.clock())
            for change in changes:
                log.warning("%s %s:%d (%s): %s", change.action, change.node, change.gpu, change.source, change.reason)
            answer: dict[str, Any] = {"node": parsed.node, "changes": [c.__dict__ for c in changes]}
            if ignored:
                answer["ignored_gpus"] = ignored
            return answer

    def _note_agent_errors(self, node: str, errors: list[str]) -> None:
        """Keep what a node's agent says is wrong (a drill file that does not parse, a GPU it cannot
        read) for status, and log it when it changes."""
        if errors == self.agent_errors.get(node, []):
            return
        if errors:
            log.warning("the agent on %s reports: %s", node, "; ".join(errors))
            self.agent_errors[node] = errors
        else:
            log.info("the agent on %s reports no more errors", node)
            self.agent_errors.pop(node, None)

    def _held_gpus(self, node: str) -> set[int]:
        """The GPUs of ``node`` that the job holds, or a burst job of this run held."""
        return {gpu for a in self.allocations for gpu in a.gpus_by_node.get(node, ())} | set(
            self.burst_node_gpus.get(node, ()))

    def endpoints_view(self, latest_weights_only: bool = False) -> dict[str, Any]:
        """The routable servers (version, endpoints with their load) for discovery."""
        with self.lock:
            return self.endpoints.view(self.clock(), latest_weights_only)

    def report_load(self, client_id: str, outstanding: dict[str, int], sent: int = 0, retried: int = 0,
                    failed: int = 0) -> dict[str, Any]:
        """A router's outstanding requests per worker; answers with the current version."""
        with self.lock:  # load on workers it does not know is not kept
            known = {w: n for w, n in outstanding.items() if w in self.state.workers}
            self.endpoints.report(client_id, known, self.clock(), sent, retried, failed)
            return {"version": self.endpoints.version}
