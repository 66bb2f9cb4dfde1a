"""The controller's loop: observe Slurm (one batched listing), run the pure core's tick, execute
its actions, persist. Errors of an action are kept and shown in status; the loop never dies on
a bad tick. The API handlers are in controller/control_plane.py, the views in controller/views.py,
the records and their persistence in controller/base.py."""

from __future__ import annotations

import logging
import threading
import time

from slurm_elastic.controller.base import STATE_REFRESH_S
from slurm_elastic.controller.control_plane import ControlPlane, UnknownWorkerError
from slurm_elastic.controller.step_specs import foreign_gpus_by_node
from slurm_elastic.controller.views import StatusViews
from slurm_elastic.core.cordons import CordonChange
from slurm_elastic.core.naming import AGENT_PREFIX, worker_id_of_step
from slurm_elastic.core.reconcile import Crashed, ObservedStep
from slurm_elastic.core.scaling import PressureInputs
from slurm_elastic.core.tick import Observation, TickResult, autoscaler_inputs, autoscales, tick
from slurm_elastic.errors import SlurmElasticError
from slurm_elastic.slurm.parse import StepInfo

__all__ = ["STATE_REFRESH_S", "Controller", "UnknownWorkerError", "foreign_gpus_by_node"]
log = logging.getLogger(__name__)


class Controller(ControlPlane, StatusViews):
    """One job's controller. Thread-safe: the API calls in while the loop ticks."""

    def observe(self) -> list[StepInfo] | None:
        """One batched listing of the job's steps; None (and an error kept) if Slurm did not answer."""
        try:
            return self.backend.list_steps(self.job_id)
        except SlurmElasticError as exc:
            self._record_error("observe", str(exc))
            return None

    def observation(self, steps: list[StepInfo] | None, now_s: float, *, with_queue: bool = True) -> Observation:
        """What the core decides on: the listing, the queue's numbers (when the autoscaler reads
        them), busy workers and the routers' load."""
        snapshot = self.queue.snapshot() if with_queue and self.queue is not None else None
        return Observation(
            steps=None if steps is None else tuple(
                ObservedStep(wid, st.step_id, st.nodes[0] if st.nodes else "", self.job_id)
                for st in steps if (wid := worker_id_of_step(st.name)) is not None),
            agent_nodes=frozenset() if steps is None else frozenset(
                st.name.removeprefix(AGENT_PREFIX) for st in steps if st.name.startswith(AGENT_PREFIX)),
            foreign_gpus={} if steps is None else {self.job_id: foreign_gpus_by_node(steps)},
            queue=snapshot,
            busy_workers=self.busy_workers(now_s) if snapshot else None,
            outstanding_by_worker=self.outstanding_of_draining(now_s),
            total_outstanding=self.endpoints.total_outstanding(now_s) if self.is_server else None,
        )

    def tick(self) -> TickResult:
        """Observe, decide, act, persist. Never raises for Slurm trouble."""
        steps = self.observe()
        with self.lock:
            now_s = self.clock()
            self.ticks += 1
            obs = self.observation(steps, now_s, with_queue=autoscales(self.state))
            result = tick(obs, self.state, self.tick_config, self.allocations, now_s)
            for event in result.events:
                if isinstance(event, Crashed):
                    log.warning("worker %s crashed on %s %s: %s", event.worker_id, event.node, list(event.gpus),
                                event.reason)
                elif isinstance(event, CordonChange):
                    log.warning("cordoned %s:%d: %s", event.node, event.gpu, event.reason)
                else:
                    log.warning("%s", event.message)
            self._run_all(result.actions)
            self._publish_endpoints()
            self.save()
        return result

    def pressure_inputs(self, allowed_slots: int, now_s: float) -> PressureInputs:
        """What the autoscaler would see now."""
        with self.lock:
            return autoscaler_inputs(self.state, self.observation(None, now_s), allowed_slots, self.tick_config)

    def run_forever(self, stop: threading.Event) -> None:
        """Tick every ``tick_interval_s`` until ``stop`` is set."""
        interval_s = self.config.controller.tick_interval_s
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except Exception as exc:  # the loop never dies on one bad tick
                log.exception("tick failed")
                self._record_error("tick", f"{type(exc).__name__}: {exc}")
            with self.lock:
                self.tick_durations_s.append(time.monotonic() - started)
                self.tick_total_s += self.tick_durations_s[-1]
            stop.wait(max(0.0, interval_s - (time.monotonic() - started)))
