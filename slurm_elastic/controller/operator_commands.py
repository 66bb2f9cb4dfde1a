"""The operator's commands to the controller: scale, pause, resume, wake-all, stop, drain, cordon, uncordon."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import Any

from slurm_elastic.controller.control_plane import ControlPlane, UnknownWorkerError
from slurm_elastic.core.placement import cordon_note
from slurm_elastic.core.reconcile import release_placeholders
from slurm_elastic.core.tick import operator_drain

log = logging.getLogger(__name__)
PLACEHOLDER_AT_STOP = "placeholder released: the controller stopped (slurm-elastic stop)"


class OperatorCommands(ControlPlane):
    """The API's handlers of the operator's commands. Each takes the controller's lock and saves
    what it changed; decisions that need the core go through it (an operator drain is
    :func:`slurm_elastic.core.tick.operator_drain`)."""

    def scale(self, n: int) -> dict[str, Any]:
        with self.lock:
            target = max(0, int(n))
            self._set_saved(manual_target=target, wake_all_active=False, paused=True)
            self.wake_loop()
            answer: dict[str, Any] = {"target_workers": target, "paused": True}
            notes = []
            if self.usable_slots is not None and target > self.usable_slots:
                more = "a lifted cordon" if self.burst is None else (  # usable_slots counts every job max_jobs allows
                    f"a lifted cordon, a held or suspended burst job let go; burst jobs up to burst.max_jobs = "
                    f"{self.burst.policy.max_jobs}, held or suspended ones aside, are counted in already")
                notes.append(f"{target} workers asked; {self.usable_slots} GPU slot"
                             f"{' is' if self.usable_slots == 1 else 's are'} usable now, so "
                             f"{self.usable_slots} run and the rest wait for GPUs ({more})")
            max_workers = self.state.autoscaler.config.max_workers
            if target > max_workers:
                notes.append(f"above autoscaler.max_workers ({max_workers}): a manual target is not bound by it")
            if notes:
                answer["note"] = "; ".join(notes)
            return self._noting_drain(answer)

    def pause(self) -> dict[str, Any]:
        """Hold the target where it is; under wake-all or a manual target (both hold it already)
        the answer says what holds it and what ends that."""
        with self.lock:
            st = self.state
            self._set_saved(paused=True)
            if st.wake_all_active:
                return self._noting_drain({
                    "paused": True, "note": "wake-all holds the count already (a worker on every usable GPU): "
                                            "`scale N` holds N instead, `resume` gives the count back to the autoscaler"})
            if st.manual_target is not None:
                return self._noting_drain({"paused": True, "note": f"the manual target {st.manual_target} holds the "
                                                                   "count already: `resume` gives it back to the autoscaler"})
            return self._noting_drain({"paused": True})

    def resume(self) -> dict[str, Any]:
        with self.lock:
            st = self.state
            self._set_saved(paused=False, manual_target=None, wake_all_active=False)
            self.wake_loop()
            if not st.autoscaler.config.enabled:
                return self._noting_drain({
                    "paused": False, "note": "the autoscaler is disabled in the job's configuration ([autoscaler] "
                                             "enabled = false): the count stays at the target until `scale`"})
            return self._noting_drain({"paused": False})

    def wake_all(self) -> dict[str, Any]:
        with self.lock:
            self._set_saved(wake_all_active=True, manual_target=None, paused=True)
            self.wake_loop()
            return self._noting_drain({"wake_all": True})

    @contextlib.contextmanager
    def _undone_unless_saved(self, *changed: object) -> Iterator[None]:
        """Run the block, which changes ``changed`` and saves; if it raises (the save failed),
        ``changed`` are set back as they were: the 503 the request gets means nothing changed."""
        before = [copy.deepcopy(vars(obj)) for obj in changed]
        try:
            yield
        except BaseException:
            for obj, fields in zip(changed, before, strict=True):
                vars(obj).clear()
                vars(obj).update(fields)
            raise

    def _set_saved(self, **fields: Any) -> None:
        """Set the state's ``fields`` and save them; if the save fails they are set back, so that
        the 503 the request gets means what it says: nothing changed (before, the target changed
        in memory while the operator was told that storage failed)."""
        before = {name: getattr(self.state, name) for name in fields}
        for name, value in fields.items():
            setattr(self.state, name, value)
        try:
            self.save()
        except BaseException:
            for name, value in before.items():
                setattr(self.state, name, value)
            raise

    def _noting_drain(self, answer: dict[str, Any]) -> dict[str, Any]:
        """``answer``, its note saying so while every worker drains before the job's time limit (call
        under the lock): the count asked for applies once the limit is raised, not before."""
        if self.state.last_decision.get("action") == "drain":
            drain = ("the job's time limit is near: every worker drains and none is launched; this count applies "
                     "if the limit is raised (scontrol update JobId=... TimeLimit=...)")
            answer["note"] = f"{answer['note']}; {drain}" if answer.get("note") else drain
        return answer

    def request_stop(self) -> dict[str, Any]:
        """End the loop (an operator's stop): the process exits 0 and worker steps keep running;
        placeholders' steps are cancelled (no controller follows to release their GPUs)."""
        log.info("an operator asked the controller to stop (worker steps keep running)")
        with self.lock:
            cancels = release_placeholders(self.state.workers, PLACEHOLDER_AT_STOP, self.clock())
            self._save_behind()
        for cancel in cancels:  # outside the lock: heartbeats go on meanwhile
            self._run(cancel)
        self.stop_requested.set()
        self.wake_loop()
        return {"stopping": True, "placeholders_released": [cancel.worker_id for cancel in cancels]}

    def drain(self, worker_id: str) -> dict[str, Any]:
        """Drain one worker now (it is replaced if the target still asks for it)."""
        with self.lock:
            worker = self.state.workers.get(worker_id)
            if worker is None:
                raise UnknownWorkerError(f"{worker_id}: no worker of that id in job {self.job_id} "
                                         f"(`slurm-elastic status {self.job_id}` lists them)")
            if not worker.has_step:
                last = worker.history[-1][3] if worker.history else ""
                raise UnknownWorkerError(f"{worker_id}: no step runs for it, nothing to drain (it is "
                                         f"{worker.state.value}" + (f": {last})" if last else ")"))
            now_s = self.clock()
            try:
                with self._undone_unless_saved(worker):
                    actions = operator_drain(self.state, worker, self.tick_config,
                                             {worker_id: self.endpoints.outstanding(worker_id, now_s)}, now_s)
                    self.save()  # write-ahead: a successor of a controller killed after the signal drains it too
            finally:
                self._publish_endpoints()
            for action in actions:
                self._run(action)
            self._save_behind()  # the signal is sent: the drain stands whether this save holds or not
            return {"worker_id": worker_id, "state": worker.state.value}

    def cordon(self, node: str, gpu: int, reason: str) -> dict[str, Any]:
        self._check_gpu(node, gpu)
        with self.lock:
            with self._undone_unless_saved(self.state.cordons):
                self.state.cordons.cordon_manual(node, gpu, reason or "cordoned by operator", self.clock())
                self.save()
            log.warning("cordon %s:%d (operator): %s", node, gpu, reason or "no reason given")
            holders = {key: w.worker_id for w in self.state.workers.values()
                       if w.keeps_step and not w.placeholder for key in w.gpu_keys}
            holders |= {key: "" for w in self.state.workers.values() if w.keeps_step and w.placeholder
                        for key in w.gpu_keys if key not in holders}  # a placeholder: the pool's, no worker
            foreign = sum(by_node.get(node, 0) for by_node in self.state.foreign_gpus.values())
            note = cordon_note(node, gpu, sorted(self._held_gpus(node)), holders, foreign)
            return {"node": node, "gpu": gpu, "cordoned": True, **({"note": note} if note else {})}

    def uncordon(self, node: str, gpu: int, reason: str = "") -> dict[str, Any]:
        """Lift the operator's, prolog, crash and pre-flight cordons of a GPU; each lift is logged
        with the operator's ``reason``. A health cordon stays (the answer says so)."""
        self._check_gpu(node, gpu)
        with self.lock:
            with self._undone_unless_saved(self.state.cordons):
                lifted = self.state.cordons.uncordon_manual(node, gpu, self.clock())
                self.save()
            for change in lifted:
                log.warning("uncordon %s:%d (%s) by operator: %s", node, gpu, change.source, reason or "no reason given")
            still = self.state.cordons.cordoned().get((node, gpu))
            return {"node": node, "gpu": gpu, "cordoned": still is not None, "lifted": [c.source for c in lifted],
                    "reason": still.reason if still else "", "source": still.source if still else ""}

    def _check_gpu(self, node: str, gpu: int) -> None:
        """UnknownWorkerError unless ``node:gpu`` is the job's own, or a burst job's of this run."""
        if gpu not in self._held_gpus(node):
            raise UnknownWorkerError(f"{node}:{gpu} is not a GPU of job {self.job_id} "
                                     f"(`slurm-elastic status {self.job_id}` lists its workers' GPUs)")
