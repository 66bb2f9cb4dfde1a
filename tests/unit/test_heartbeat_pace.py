"""A large pool heart-beats more slowly: the controller tells its workers the interval that keeps
the pool within ``workers.max_heartbeats_per_s``, and the wrapper and the SDK beat at it."""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.client.answers import paced_interval_s
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.heartbeat_pace import heartbeat_interval_s, heartbeat_senders
from slurm_elastic.core.lifecycle import Worker, WorkerState
from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.slurm.parse import StepInfo
from slurm_elastic.worker.context import StepContext
from slurm_elastic.worker.heartbeats import Heartbeats
from slurm_elastic.worker.wrapper import Flags, run_wrapped
from tests.stub_backend import ListedSteps

CTX = StepContext(worker_id="0001", controller_url="http://controller", token="t", heartbeat_interval_s=5.0,
                  drain_signal="USR1", node="n1", gpus=(0,), step_id="1", job_id="1")


@pytest.mark.parametrize(("senders", "expected_s"), [
    (0, 5.0), (1, 5.0), (100, 5.0),  # up to 20/s x 5 s: the configured interval
    (101, 5.1), (256, 12.8), (300, 15.0),  # then the senders / 20 per s, rounded up to 0.1 s
    (512, 15.0), (100_000, 15.0),  # at most a quarter of the 60 s grace
])
def test_the_interval_keeps_the_senders_within_their_heartbeats_per_second(senders: int, expected_s: float) -> None:
    assert heartbeat_interval_s(senders, 5.0, 20.0, 60.0) == expected_s


@pytest.mark.parametrize("senders", [1, 7, 99, 101, 133, 256, 299, 1024])
@pytest.mark.parametrize(("interval_s", "max_per_s", "grace_s"), [(5.0, 20.0, 60.0), (1.0, 3.0, 10.0), (0.5, 50.0, 600.0),
                                                                  (5.0, 5e-324, 1e9)])
def test_the_pace_bounds(senders: int, interval_s: float, max_per_s: float, grace_s: float) -> None:
    paced_s = heartbeat_interval_s(senders, interval_s, max_per_s, grace_s)
    assert paced_s >= interval_s  # never faster than configured
    assert paced_s <= max(interval_s, min(grace_s / 4, 3600.0))  # four beats within the grace; an hour at most
    if paced_s < min(grace_s / 4, 3600.0):
        assert senders / paced_s <= max_per_s + 1e-9  # the senders within their budget


def test_the_senders_are_each_running_steps_wrapper_and_its_tasks_sdk() -> None:
    def worker(worker_id: str, state: WorkerState) -> Worker:
        return Worker(worker_id=worker_id, state=state)

    pool = [worker("0001", WorkerState.ACTIVE), worker("0002", WorkerState.STARTING), worker("0003", WorkerState.DRAINING),
            worker("0004", WorkerState.FAILED), worker("0005", WorkerState.BACKOFF), worker("0006", WorkerState.SUSPENDED),
            worker("0007", WorkerState.INACTIVE)]
    assert heartbeat_senders(pool, set(), 1) == 3  # the wrappers of the three running steps
    assert heartbeat_senders(pool, {"0001", "0004"}, 1) == 4  # and the SDK of 0001 (0004 has no step)
    assert heartbeat_senders(pool, {"0001", "0002"}, 4) == 11  # a step of 4 tasks: an SDK beats in each


@pytest.mark.parametrize("answer", [{}, {"heartbeat_interval_s": None}, {"heartbeat_interval_s": "12"},
                                    {"heartbeat_interval_s": True}, {"heartbeat_interval_s": 0},
                                    {"heartbeat_interval_s": -3.0}, {"heartbeat_interval_s": float("nan")},
                                    {"heartbeat_interval_s": float("inf")}, {"heartbeat_interval_s": 3601}])
def test_an_answer_without_a_usable_interval_keeps_the_current_one(answer: dict[str, Any]) -> None:
    assert paced_interval_s(answer, 5.0) == 5.0


def test_an_answer_with_an_interval_sets_it() -> None:
    assert paced_interval_s({"heartbeat_interval_s": 12.8}, 5.0) == 12.8
    assert paced_interval_s({"heartbeat_interval_s": 5}, 12.8) == 5.0  # a pool that shrank beats faster again


def test_the_controller_answers_a_large_pool_with_a_longer_interval(tmp_path: Path) -> None:
    """Eight workers allowed one heartbeat a second together beat every 8 s, 16 s once their SDK
    beats too; registration, heartbeat and status say the same. A pool that shrank beats faster."""
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0},
                           "workers": {"max_heartbeats_per_s": 1.0}})
    backend = ListedSteps()
    controller = Controller(config, 1, backend, tmp_path, gpus_by_node={"n1": tuple(range(8))})  # type: ignore[arg-type]
    assert controller.status()["heartbeat_interval_s"] == 5.0
    controller.scale(8)
    controller.tick()
    ids = sorted(controller.workers)
    for number, worker_id in enumerate(ids, start=1):
        worker = controller.workers[worker_id]
        backend.steps.append(StepInfo(1, str(number), worker_step_name(worker_id), (worker.node,), "0:01", "",
                                      "gres/gpu:1", 1))
        answer = controller.register_worker(worker_id, {"node": worker.node, "gpus": list(worker.gpus),
                                                        "step_id": str(number)})
        assert answer["heartbeat_interval_s"] == 8.0
    assert controller.heartbeat(ids[0], {"busy": True})["heartbeat_interval_s"] == 8.0
    for worker_id in ids:  # each command's SDK beats too (its counts, as this process)
        controller.heartbeat(worker_id, {"busy": True, "instance": "a" * 32, "step": f"1.{ids.index(worker_id) + 1}"})
    controller.tick()
    assert controller.heartbeat(ids[0], {"busy": True})["heartbeat_interval_s"] == 15.0  # 16, at most 60 / 4
    assert controller.status()["heartbeat_interval_s"] == 15.0  # what an operator reads, on /metrics too
    assert controller.status()["heartbeat_senders"] == 16  # 8 wrappers, 8 SDKs
    backend.steps[:] = backend.steps[:2]  # six steps ended
    controller.scale(2)
    for _ in range(3):
        controller.tick()
    assert sum(1 for w in controller.workers.values() if w.has_step) == 2
    assert controller.heartbeat(ids[0], {"busy": True})["heartbeat_interval_s"] == 5.0  # 4 senders: as configured


def test_the_wrapper_beats_at_the_interval_the_last_answer_asked_for() -> None:
    """Configured 5 s, told 0.05 s at registration (its command's SDK too) and 0.4 s by its first
    heartbeat's answer: it beats 0.4 s apart from then, a few times in a 1.3 s command."""
    beats: list[float] = []

    def register(info: dict[str, Any]) -> dict[str, Any]:
        return {"action": "run", "heartbeat_interval_s": 0.05}

    def heartbeat(payload: dict[str, Any]) -> dict[str, Any]:
        beats.append(time.monotonic())
        return {"drain": False, "hold": False, "register": False, "heartbeat_interval_s": 0.4}

    script = "import os, time; assert os.environ['SLURM_ELASTIC_HEARTBEAT_INTERVAL_S'] == '0.05'; time.sleep(1.3)"
    code = run_wrapped([sys.executable, "-c", script], CTX, register, heartbeat, flags=Flags())
    assert code == 0
    assert 2 <= len(beats) - 1 < 10, beats  # the last one reports the exit code; at 5 s: none, at 0.05 s: ~26
    assert all(b - a >= 0.35 for a, b in itertools.pairwise(beats[:-1])), beats


def test_a_placeholder_beats_at_the_interval_the_last_answer_asked_for() -> None:
    beats: list[float] = []
    flags = Flags()

    def heartbeat(payload: dict[str, Any]) -> dict[str, Any]:
        beats.append(time.monotonic())
        if len(beats) == 4:
            flags.terminate.set()
        return {"drain": False, "hold": True, "register": False, "heartbeat_interval_s": 0.1}

    def register(info: dict[str, Any]) -> dict[str, Any]:
        return {"action": "hold", "heartbeat_interval_s": 0.1}

    start = time.monotonic()
    run_wrapped([sys.executable, "-c", "pass"], CTX, register, heartbeat, flags=flags)
    assert time.monotonic() - start < 4.0  # 0.1 s apart, not the configured 5 s


def test_the_sdk_beats_at_the_interval_the_last_answer_asked_for() -> None:
    beats: list[float] = []

    class Control:
        def heartbeat(self, info: dict[str, Any]) -> dict[str, Any]:
            beats.append(time.monotonic())
            return {"drain": False, "hold": False, "register": False, "heartbeat_interval_s": 0.3}

    heartbeats = Heartbeats(dataclasses.replace(CTX, heartbeat_interval_s=0.05), Control(),  # type: ignore[arg-type]
                            lambda: {"rollouts": 0}, threading.Event())
    heartbeats.start()
    time.sleep(1.0)
    heartbeats.stop()
    assert heartbeats.interval_s == 0.3
    assert 2 <= len(beats) - 1 <= 5, beats  # the last is the closing one; at 0.05 s: ~20
