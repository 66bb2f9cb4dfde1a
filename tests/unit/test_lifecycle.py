"""One test per allowed transition, and every disallowed one refused."""

from __future__ import annotations

import itertools

import pytest

from slurm_elastic.core.lifecycle import TRANSITIONS, Worker, WorkerState, transition
from slurm_elastic.errors import TransitionError

ALLOWED = [(a, b) for a, targets in TRANSITIONS.items() for b in targets]
REFUSED = [(a, b) for a, b in itertools.product(WorkerState, WorkerState) if b not in TRANSITIONS[a]]


@pytest.mark.parametrize(("start", "end"), ALLOWED, ids=lambda s: s.value)
def test_allowed_transition_is_recorded(start: WorkerState, end: WorkerState) -> None:
    worker = Worker("0001", state=start)
    transition(worker, end, 12.5, "because")
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
        transition(worker, state, 0.0, "")
    assert [h[2] for h in worker.history] == ["ACTIVE", "DRAINING", "INACTIVE"]


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
