"""A worker written from the docs, misused as users do: each mistake gets a clear error at once,
and no group the controller accepted is lost. Before: ``admit(0)`` and ``admit(-3)`` returned 0
without a word; a waiting ``admit`` for more than may run at once waited without a word; a call
after ``close()`` raised httpx's "Cannot send a request, as the client has been closed"; a worker
never started (no ``with``) ran without its drain handler and heartbeats unannounced; a group
that named another worker was submitted under that worker's lease; a task above rank 0 sent its
own counts as the step's (two SDK loops under one id interleaved them); ``start()`` outside the
main thread raised Python's "signal only works in main thread"; a group over
``queue.max_group_bytes`` got a 413 that named neither the group nor the key."""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slurm_elastic.errors import ApiError
from slurm_elastic.worker import RolloutWorker
from slurm_elastic.worker.context import StepContext
from tests.unit.served_controller import ServedController

TOKEN = "misuse-token"


def group(group_id: str, n: int = 4, version: int = 0) -> dict[str, Any]:
    return {"id": group_id, "policy_version": version, "group_size": n,
            "sequences": [{"tokens": [1, 2, 3], "mask": [0, 1, 1], "score": 0.5} for _ in range(n)]}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedController]:
    server = ServedController(tmp_path, TOKEN, batch_size=8).launched("0001")
    yield server
    server.close()


@pytest.fixture
def make_worker(served: ServedController, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("SLURM_ELASTIC_WORKER_ID", "0001")
    monkeypatch.setenv("SLURM_ELASTIC_CONTROLLER_URL", served.url)
    monkeypatch.setenv("SLURM_ELASTIC_TOKEN", TOKEN)
    made: list[RolloutWorker] = []

    def make() -> RolloutWorker:
        made.append(RolloutWorker.from_env())
        return made[-1]
    yield make
    for worker in made:
        worker.close()


@pytest.mark.parametrize("count", [0, -3, True, 2.0, "4"])
def test_a_count_that_is_no_whole_number_of_at_least_1_is_a_value_error(make_worker: Any, count: Any) -> None:
    worker = make_worker()
    with pytest.raises(ValueError, match=r"RolloutWorker.admit: sequences must be a whole number of at least 1"):
        worker.admit(count)
    with pytest.raises(ValueError, match=r"RolloutWorker.give_back: sequences must be"):
        worker.give_back(count)


def test_a_waiting_ask_for_more_than_may_run_at_once_is_logged_naming_the_bound_and_waits(
        make_worker: Any, served: ServedController, caplog: pytest.LogCaptureFixture) -> None:
    """Not refused: once the trainer's versions run ahead of its batches, the staleness window
    holds more than (max_staleness + 1) batches, and the ask is granted (a refusal there was wrong,
    and a worker that exits on it is counted a crash against its GPU)."""
    worker = make_worker()
    most = (4 + 1) * 8  # (max_staleness + 1) x batch_size, under max_concurrent
    caplog.set_level(logging.WARNING, logger="slurm_elastic.worker")
    got: list[int] = []
    asking = threading.Thread(target=lambda: got.append(worker.admit(most + 1, poll_s=0.05)), daemon=True)
    asking.start()
    deadline = time.monotonic() + 30
    while "more than a steady run lets run at once (40" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "RolloutWorker.admit(41) waits for 41 sequences at once" in caplog.text, caplog.text
    assert asking.is_alive() and served.queue.staleness.running == 0  # waiting, nothing granted in parts
    served.queue.set_version(1)  # the trainer's versions ahead of its batches: (4 + 1 + 1) x 8 = 48 of room
    asking.join(timeout=30)
    assert got == [most + 1] and caplog.text.count("waits for 41 sequences at once") == 1  # said once
    assert worker.give_back(most + 1) == most + 1
    assert worker.admit(most + 1, wait=False) >= most  # without waiting: what the bound allows, as before
    assert worker.give_back(np.int64(4)) == 4 and worker.admit(np.int64(4)) == 4  # a numpy count is a count


def test_calls_after_close_say_so(make_worker: Any, served: ServedController) -> None:
    worker = make_worker()
    assert worker.submit(group("g1"))["accepted"] is True
    worker.close()
    for call in (lambda: worker.submit(group("g2")), lambda: worker.admit(4), lambda: worker.give_back(4),
                 worker.start):
        with pytest.raises(RuntimeError, match=r"closed"):
            call()
    assert served.queue.stats()["queued_sequences"] == 4  # the group accepted before is there


def test_a_group_naming_another_worker_is_refused_before_it_is_sent(make_worker: Any, served: ServedController) -> None:
    worker = make_worker()
    with pytest.raises(ValueError, match=r"worker_id '0002' is not this worker's \('0001'\); leave it out"):
        worker.submit({**group("g1"), "worker_id": "0002"})  # a group copied from a batch, say
    assert worker.submit({**group("g1"), "worker_id": "0001"})["accepted"] is True
    assert served.queue.stats()["queued_sequences"] == 4


def test_a_worker_started_outside_the_main_thread_says_where_to_start_it(make_worker: Any) -> None:
    worker, raised = make_worker(), []

    def start() -> None:
        try:
            worker.start()
        except RuntimeError as exc:
            raised.append(str(exc))
    thread = threading.Thread(target=start, name="rollouts")
    thread.start()
    thread.join()
    assert raised and "from thread 'rollouts'" in raised[0] and "only the main thread can" in raised[0]


def test_a_worker_used_without_start_is_warned_of_once(make_worker: Any, caplog: pytest.LogCaptureFixture) -> None:
    worker = make_worker()
    with caplog.at_level(logging.WARNING, logger="slurm_elastic.worker"):
        assert worker.admit(4) == 4 and worker.submit(group("g1"))["accepted"] is True
    told = [r.getMessage() for r in caplog.records if "before start()" in r.getMessage()]
    assert len(told) == 1 and "with RolloutWorker.from_env() as worker" in told[0]


def test_a_group_over_max_group_bytes_names_the_group_and_the_key(make_worker: Any, served: ServedController) -> None:
    worker = make_worker()
    served.server.app.guard.submit_max_bytes = 200_000  # type: ignore[attr-defined]  # queue.max_group_bytes
    big = {"id": "big", "policy_version": 0, "group_size": 1, "sequences": [{"tokens": [7] * 60_000, "score": 1.0}]}
    with pytest.raises(ApiError, match=r"rollout group 'big' is \d+ bytes as sent, over queue.max_group_bytes") as caught:
        worker.submit(big)
    assert caught.value.status_code == 413 and served.queue.stats()["queued_sequences"] == 0


class RecordedControl:
    def __init__(self) -> None:
        self.beats: list[dict[str, Any]] = []

    def heartbeat(self, info: dict[str, Any]) -> dict[str, Any]:
        self.beats.append(info)
        return {"drain": True}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_reports_the_steps_counts_and_every_rank_hears_a_drain(rank: int) -> None:
    ctx = StepContext(worker_id="0007", controller_url="http://127.0.0.1:1", token="t", heartbeat_interval_s=3600,
                      drain_signal="USR1", node="node1", gpus=(0,), step_id="3", job_id="1", rank=rank)
    control = RecordedControl()
    handler = signal.getsignal(signal.SIGUSR1)
    try:
        worker = RolloutWorker(ctx, control=control).start()  # type: ignore[arg-type]
        with worker.rollout():
            pass
        worker.close()
    finally:
        signal.signal(signal.SIGUSR1, handler)
    mine = {"instance": worker.beats.instance, "step": "1.3"}
    last = {"busy": False, "rollouts": 1, "busy_s": pytest.approx(0, abs=0.1), **mine, "closing": True}
    assert control.beats == ([last] if rank == 0 else [{}])  # start() sends none: the last one, at close
    assert worker.draining  # the answer's drain reaches every rank's loop


def test_a_waiting_ask_over_max_concurrent_is_refused_it_could_never_be_granted(
        make_worker: Any, served: ServedController, monkeypatch: pytest.MonkeyPatch) -> None:
    """max_concurrent is a hard bound (AReaL's capacity is at most max_concurrent - running), unlike
    the staleness window: a whole ask over it would wait for ever."""
    monkeypatch.setattr(served.queue, "config", dataclasses.replace(served.queue.config, max_concurrent=16))
    worker = make_worker()
    with pytest.raises(ApiError, match=r"17 sequences asked for whole can never be granted: at most "
                                       r"queue.max_concurrent = 16") as caught:
        worker.admit(17)
    assert caught.value.status_code == 422 and served.queue.staleness.running == 0


def test_a_second_group_under_an_id_already_stored_is_warned_of_naming_the_id(
        make_worker: Any, served: ServedController, caplog: pytest.LogCaptureFixture) -> None:
    """Two tasks of a step (workers.tasks_per_node = 2) that number their groups by worker id and a
    counter send the same ids: the second of each is not stored. Before, it was answered
    ``{"accepted": false}`` without a word: a docs-style worker with two tasks lost half its
    groups silently (on a dev cluster job, 2 of its groups stored and the trainer stalled)."""
    worker = make_worker()
    with caplog.at_level(logging.WARNING, logger="slurm_elastic.worker"):
        assert worker.submit(group("0001-1"))["accepted"] is True
        assert "not stored" not in caplog.text
        assert worker.submit(group("0001-1")) == {"accepted": False}  # another task's group, same id
    told = [r.getMessage() for r in caplog.records if "a group of this id was stored before" in r.getMessage()]
    assert len(told) == 1 and "rollout group 0001-1 not stored" in told[0] and "uuid.uuid4().hex" in told[0]
    assert served.queue.stats()["queued_sequences"] == 4


class OlderControl(RecordedControl):
    """A controller that knows neither the ``step`` nor the ``instance`` field (422 naming it)."""

    def heartbeat(self, info: dict[str, Any]) -> dict[str, Any]:
        for field in ("step", "instance"):
            if field in info:
                raise ApiError(422, f"body.{field}: Extra inputs are not permitted")
        return super().heartbeat(info)


def test_an_older_controller_gets_the_counts_without_the_fields_it_refuses() -> None:
    ctx = StepContext(worker_id="0007", controller_url="http://127.0.0.1:1", token="t", heartbeat_interval_s=3600,
                      drain_signal="USR1", node="node1", gpus=(0,), step_id="3", job_id="1")
    control = OlderControl()
    handler = signal.getsignal(signal.SIGUSR1)
    try:
        worker = RolloutWorker(ctx, control=control).start()  # type: ignore[arg-type]
        worker.close()
    finally:
        signal.signal(signal.SIGUSR1, handler)
    assert worker.beats.step is None and worker.beats.instance is None
    assert control.beats == [{"busy": False, "rollouts": 0, "busy_s": 0.0}]  # the last beat, at close
