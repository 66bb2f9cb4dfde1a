"""The rollout queue's numbers as the autoscaler takes them (pure).

The queue produces a typed :class:`QueueSnapshot`; :func:`pressure_inputs` turns it, with the
workers' counts, into the autoscaler's :class:`~slurm_elastic.core.scaling.PressureInputs`.
The controller gets its queue as a :class:`QueueFeed` when it is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from slurm_elastic.core.lifecycle import WorkerState
from slurm_elastic.core.rates import per_worker_rate
from slurm_elastic.core.scaling import PressureInputs


@dataclass(frozen=True)
class QueueSnapshot:
    """The queue at one moment: sequences (``_seqs``) and rates per second (None: nothing measured yet)."""

    queued_seqs: int
    batch_size: int
    consumption_seqs_per_s: float | None
    production_seqs_per_s: float | None
    in_flight_seqs: int  # admitted, not yet submitted (the staleness manager's running)
    max_staleness: int
    staleness_capacity_seqs: int
    buffer_capacity_seqs: int
    trainer_step_s: float | None = None  # the trainer's compute time per step (core.rates.TrainerSteps)
    trainer_waiting: bool | None = None  # the trainer waits for a batch now (None: it has not asked yet)
    produced_seqs: int | None = None  # accepted over the last PRODUCTION_WINDOW_S (None: not counted)
    trainer_latest_step_s: float | None = None  # the last step's compute time (TrainerSteps.latest_step_s)
    smallest_group_seqs: int | None = None  # of the last groups accepted (core.rates.GroupSizes)


class QueueFeed(Protocol):
    """What the controller reads from its rollout queue."""

    def snapshot(self) -> QueueSnapshot | None:
        """The numbers now; None until the queue is in use (a job of inference servers with no
        trainer must not look like a starving trainer)."""

    def stats(self) -> dict[str, Any]:
        """Every number of the queue, for the status."""

    def release_leases(self, worker_ids: list[str]) -> int:
        """The steps of ``worker_ids`` have ended: their admissions are released."""

    def hold_leases(self, stopped: list[str]) -> None:
        """The steps of ``stopped`` stand stopped now (a suspended job): their admissions stay, and
        the admission TTL does not run for them."""


def pressure_inputs(queue: QueueSnapshot | None, workers: Mapping[WorkerState, int], busy_worker_s: float | None,
                    allowed_slots: int, outstanding_requests: int | None = None,
                    burst_slots: int = 0, workers_loading: int = 0) -> PressureInputs:
    """What the autoscaler sees. ``workers``: workers by state (placeholders not counted);
    ``busy_worker_s``: worker-seconds inside rollouts over the production window (None: not
    reported), which makes production per worker the production per *busy* worker."""
    active = workers.get(WorkerState.ACTIVE, 0)
    idle = PressureInputs(
        queued_seqs=None, batch_size=0,
        workers_starting=workers.get(WorkerState.STARTING, 0) + workers.get(WorkerState.BACKOFF, 0),
        workers_active=active, workers_draining=workers.get(WorkerState.DRAINING, 0),
        workers_loading=workers_loading, allowed_slots=allowed_slots, burst_slots=burst_slots,
        outstanding_requests=outstanding_requests,
    )
    if queue is None:
        return idle
    return replace(
        idle, queued_seqs=queue.queued_seqs, batch_size=queue.batch_size,
        consumption_seqs_per_s=queue.consumption_seqs_per_s,
        per_worker_seqs_per_s=per_worker_rate(queue.production_seqs_per_s, queue.produced_seqs, busy_worker_s,
                                              active),
        trainer_demand_seqs_per_s=(queue.batch_size / queue.trainer_step_s
                                   if queue.trainer_step_s and queue.trainer_step_s > 0 else None),
        trainer_latest_demand_seqs_per_s=(queue.batch_size / queue.trainer_latest_step_s
                                          if queue.trainer_latest_step_s and queue.trainer_latest_step_s > 0
                                          else None),
        trainer_waiting=queue.trainer_waiting,
        in_flight_seqs=queue.in_flight_seqs, max_staleness=queue.max_staleness,
        staleness_capacity_seqs=queue.staleness_capacity_seqs, buffer_capacity_seqs=queue.buffer_capacity_seqs,
        smallest_group_seqs=queue.smallest_group_seqs,
    )
