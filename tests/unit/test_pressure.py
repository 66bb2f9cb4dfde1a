"""The queue's numbers as the autoscaler takes them: the typed snapshot and its one translation."""

from __future__ import annotations

import dataclasses

import pytest

from slurm_elastic.core.lifecycle import WorkerState as S
from slurm_elastic.core.pressure import QueueSnapshot, pressure_inputs

SNAPSHOT = QueueSnapshot(queued_seqs=40, batch_size=32, consumption_seqs_per_s=2.0, production_seqs_per_s=6.0,
                         in_flight_seqs=12, max_staleness=2, staleness_capacity_seqs=84, buffer_capacity_seqs=512,
                         produced_seqs=720)
WORKERS = {S.STARTING: 1, S.BACKOFF: 1, S.ACTIVE: 3, S.DRAINING: 2, S.FAILED: 5}


def test_no_queue_in_use_measures_nothing_of_it_and_still_counts_workers() -> None:
    x = pressure_inputs(None, WORKERS, busy_worker_s=240.0, allowed_slots=8, outstanding_requests=7)
    assert (x.queued_seqs, x.batch_size, x.consumption_seqs_per_s, x.per_worker_seqs_per_s) == (None, 0, None, None)
    assert (x.in_flight_seqs, x.max_staleness, x.staleness_capacity_seqs, x.buffer_capacity_seqs) == (None,) * 4
    assert (x.workers_starting, x.workers_active, x.workers_draining) == (2, 3, 2)
    assert (x.allowed_slots, x.outstanding_requests) == (8, 7)


@pytest.mark.parametrize(("busy_worker_s", "per_worker"), [(240.0, 3.0), (None, 2.0), (0.0, 2.0)])
def test_the_snapshot_reaches_the_autoscaler_field_by_field(busy_worker_s: float | None, per_worker: float) -> None:
    x = pressure_inputs(SNAPSHOT, WORKERS, busy_worker_s, allowed_slots=8)
    assert (x.queued_seqs, x.batch_size, x.consumption_seqs_per_s) == (40, 32, 2.0)
    assert (x.in_flight_seqs, x.max_staleness, x.staleness_capacity_seqs, x.buffer_capacity_seqs) == (12, 2, 84, 512)
    assert x.per_worker_seqs_per_s == per_worker  # per busy worker; per ACTIVE worker without busy time
    assert x.outstanding_requests is None and x.workers_active == 3


def test_the_trainers_step_time_reaches_the_autoscaler_as_its_demand() -> None:
    x = pressure_inputs(SNAPSHOT, WORKERS, 2.0, allowed_slots=8)
    assert (x.trainer_demand_seqs_per_s, x.trainer_waiting) == (None, None)  # not measured yet
    timed = dataclasses.replace(SNAPSHOT, trainer_step_s=8.0, trainer_waiting=False)
    x = pressure_inputs(timed, WORKERS, 2.0, allowed_slots=8)
    assert (x.trainer_demand_seqs_per_s, x.trainer_waiting) == (4.0, False)  # 32 seqs per 8 s step
