"""One test per allowed transition, and every disallowed one refused."""

from __future__ import annotations

import itertools

import pytest

from slurm_elastic.core.lifecycle import (
    TRANSITIONS,
    Worker,
    WorkerState,
    begin_drain,
    resume,
    suspend,
    transition,
)
from slurm_elastic.errors import TransitionError

ORDER = list(WorkerState)
ALLOWED = [(a, b) for a, targets in TRANSITIONS.items() for b in sorted(targets, key=ORDER.index)]  # one order for xdist
REFUSED = [(a, b) for a, b in itertools.product(WorkerState, WorkerState) if b not in TRANSITIONS[a]]


def move(worker: Worker, end: WorkerState, now_s: float, reason: str) -> None:
    """DRAINING is entered through begin_drain, SUSPENDED through suspend and left (but to
    INACTIVE) through resume, every other state through transition."""
    if worker.state is WorkerState.SUSPENDED and end is not WorkerState.INACTIVE:
        worker.suspended_from = end.value  # where it was suspended from
        resume(worker, now_s, reason)
    elif end is WorkerState.DRAINING:
        begin_drain(worker, now_s, reason)
    elif end is WorkerState.SUSPENDED:
        suspend(worker, now_s, reason)
    else:
        transition(worker, end, now_s, reason)


@pytest.mark.parametrize(("start", "end"), ALLOWED, ids=lambda s: s.value)
def test_allowed_transition_is_recorded(start: WorkerState, end: WorkerState) -> None:
    worker = Worker("0001", state=start)
    move(worker, end, 12.5, "because")
    assert worker.state is end
    assert worker.history[-1] == (12.5, start.value, end.value, "because")


@pytest.mark.parametrize(("start", "end"), REFUSED, ids=lambda s: s.value)
def test_other_transitions_are_refused(start: WorkerState, end: WorkerState) -> None:
    worker = Worker("0001", state=start)
    with pytest.raises(TransitionError, match=f"{start.value} -> {end.value} is not allowed"):
        transition(worker, end, 1.0, "nope")
    assert worker.state is start and worker.history == []


def test_the_main_path_exists() -> None:
    worker = Worker("0001")
    for state in (WorkerState.ACTIVE, WorkerState.DRAINING, WorkerState.INACTIVE):
        move(worker, state, 0.0, "")
    assert [h[2] for h in worker.history] == ["ACTIVE", "DRAINING", "INACTIVE"]


def test_draining_is_entered_only_through_begin_drain_which_starts_the_drain_clock() -> None:
    worker = Worker("0001", state=WorkerState.ACTIVE)
    with pytest.raises(TransitionError, match="begin_drain"):
        transition(worker, WorkerState.DRAINING, 1.0, "by hand")
    begin_drain(worker, 7.0, "lost heartbeat", failure_reason="lost heartbeat")
    assert (worker.state, worker.drain_started_s, worker.failure_reason) == (WorkerState.DRAINING, 7.0, "lost heartbeat")
    assert worker.history[-1] == (7.0, "ACTIVE", "DRAINING", "lost heartbeat")


def test_an_old_state_file_record_without_a_job_id_is_the_controllers_own_job() -> None:
    data = Worker("0003", state=WorkerState.ACTIVE).to_json()
    del data["job_id"]
    assert Worker.from_json(data).job_id == 0


def test_worker_json_round_trip() -> None:
    worker = Worker("0007", state=WorkerState.DRAINING, gpus=(2,), node="node1", exit_code=0)
    transition(worker, WorkerState.INACTIVE, 3.0, "drained")
    assert Worker.from_json(worker.to_json()) == worker


def test_history_is_bounded() -> None:
    worker = Worker("0001", state=WorkerState.FAILED)
    for i in range(200):
        worker.state = WorkerState.FAILED
        transition(worker, WorkerState.BACKOFF, float(i), "")
    assert len(worker.history) == 50 and worker.history[-1][0] == 199.0
