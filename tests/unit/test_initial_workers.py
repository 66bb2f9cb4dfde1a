"""``workers.initial_workers`` is the count a job starts with: the autoscaler, which holds while
the queue has nothing to measure, holds it (it read the launched workers, none before the first
tick, and dropped the count to ``min_workers``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore
from tests.stub_backend import ListedSteps


@pytest.mark.parametrize(("initial", "kept"), [(3, 3), (-1, 1), (0, 1)])
def test_the_first_ticks_keep_the_initial_workers(tmp_path: Path, initial: int, kept: int) -> None:
    queue = RolloutQueue(RolloutStore(tmp_path / "q.sqlite", fsync="off"), QueueConfig(batch_size=8))
    config = parse_config({"agent": {"enabled": False}, "workers": {"command": "w", "initial_workers": initial},
                           "autoscaler": {"min_workers": 1, "max_workers": 8}})
    controller = Controller(config, 1, ListedSteps(), tmp_path, gpus_by_node={"node1": tuple(range(8))},  # type: ignore[arg-type]
                            queue=queue)
    try:
        for _ in range(3):
            controller.tick()
            status = controller.status()
            assert status["target_workers"] == kept and len(status["workers"]) == kept, status["last_decision"]
    finally:
        queue.store.close()


@contextmanager
def burst_controller(tmp_path: Path, config: dict[str, Any]) -> Iterator[tuple[Controller, Any]]:
    """A controller holding node1's 2 GPUs, allowed one 2-GPU burst job, and its stub backend."""
    from tests.unit.test_burst_memory import BurstBackend

    queue = RolloutQueue(RolloutStore(tmp_path / "q.sqlite", fsync="off"), QueueConfig(batch_size=8))
    backend = BurstBackend()
    controller = Controller(parse_config({**config, "burst": {"max_jobs": 1, "gpus_per_job": 2}}), 1, backend,  # type: ignore[arg-type]
                            tmp_path, gpus_by_node={"node1": (0, 1)}, queue=queue)
    try:
        yield controller, backend
    finally:
        queue.store.close()


def test_a_hold_keeps_workers_that_wait_for_a_burst_job(tmp_path: Path) -> None:
    """Workers the target asks for beyond the allocation wait for a burst job; a hold of the
    autoscaler keeps them asked for (it read the running workers and gave the burst job back)."""
    with burst_controller(tmp_path, {"agent": {"enabled": False}, "workers": {"command": "w", "initial_workers": 4},
                                     "autoscaler": {"min_workers": 1, "max_workers": 8}}) as (controller, backend):
        for _ in range(3):
            controller.tick()
            assert controller.status()["target_workers"] == 4
        assert len(backend.submitted) == 1 and len(controller.workers) == 2  # two more once the burst job runs


def test_with_agents_on_the_initial_workers_wait_for_the_first_report_and_no_burst_job_is_asked(
        tmp_path: Path) -> None:
    """Agents are on by default and no GPU takes a worker before its node's agent reports: the
    first ticks saw no usable GPU and dropped the count to zero (seen on a real GPU node); with a
    burst table they would also have asked for a burst job to hold what the allocation holds."""
    from slurm_elastic.core.health import AgentReport, GpuSample

    with burst_controller(tmp_path, {"workers": {"command": "w", "initial_workers": 2},
                                     "autoscaler": {"min_workers": 0, "max_workers": 4}}) as (controller, backend):
        for _ in range(3):
            controller.tick()
            status = controller.status()
            assert status["target_workers"] == 2 and not controller.workers
            assert status["usable_slots"] == 4  # what `scale --wait` waits for: 2 GPUs to be reported on, 2 a burst job's
        controller.report_gpu_health(AgentReport("node1", 0.0, "inject", [
            GpuSample("node1", gpu, temperature_c=40.0, memory_used_mb=0, memory_total_mb=80000) for gpu in (0, 1)]))
        controller.tick()
        assert len(controller.workers) == 2 and not backend.submitted


def test_a_floor_the_allocation_can_never_hold_is_said_at_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """min_workers = 5 on 4 GPUs beside a 1-GPU trainer: the controller says so once at start, naming
    the key and the slots, and runs those that fit (before: nothing said, the target stayed at 5 for
    ever). It counts as render does, the trainer's GPUs out (before: over the whole allocation)."""
    from slurm_elastic.controller.main import build_controller, unplaceable_floor
    from slurm_elastic.slurm.parse import JobInfo

    config = parse_config({"agent": {"enabled": False}, "workers": {"command": "w"},
                           "autoscaler": {"min_workers": 5, "max_workers": 8}})
    job = JobInfo(1, "rl", "RUNNING", ("node1",), "node1", "", "u", "debug", gpus_by_node={"node1": (0, 1, 2, 3)})
    with caplog.at_level("ERROR"):
        controller = build_controller(config, job, ListedSteps(), tmp_path)  # type: ignore[arg-type]
    said = ("autoscaler.min_workers = 5 workers can never all be placed: this job's 1 node(s) with 4 GPUs, "
            "job.trainer_gpus = 1 of them the trainer's, hold at most 3 of workers.gpus_per_worker = 1. The "
            "controller runs the 3 that fit and never places the other 2")
    assert said in caplog.text
    assert [e["where"] for e in controller.status()["errors"]] == ["config"]
    controller.tick()  # no trainer step listed here: all 4 GPUs take one
    assert controller.status()["target_workers"] == 5 and len(controller.status()["workers"]) == 4
    with_burst = parse_config({"workers": {"command": "w"}, "autoscaler": {"min_workers": 4, "max_workers": 8},
                               "burst": {"max_jobs": 1, "gpus_per_job": 1}})
    assert unplaceable_floor(with_burst, {"node1": (0, 1, 2, 3)}) == ""  # a burst job may hold the fourth
    fits = parse_config({"workers": {"command": "w"}, "autoscaler": {"min_workers": 3, "max_workers": 8}})
    assert unplaceable_floor(fits, {"node1": (0, 1, 2, 3)}) == ""
    no_trainer_gpus = parse_config({"workers": {"command": "w"}, "job": {"trainer_gpus": 0},
                                    "autoscaler": {"min_workers": 4, "max_workers": 8}})
    assert unplaceable_floor(no_trainer_gpus, {"node1": (0, 1, 2, 3)}) == ""


@pytest.mark.parametrize(("floor", "says"), [(8, "runs the 7 that fit and never places the other 1"),
                                             (9, "runs the 7 that fit and never places the other 2")])
def test_the_start_check_leaves_the_trainers_gpus_out_as_render_does(floor: int, says: str) -> None:
    """2 nodes x 4 GPUs beside a 1-GPU trainer hold 7 workers: render refuses min_workers = 8, and
    the controller's start check says so too (before: nothing said at 8, '8 that fit' at 9)."""
    from slurm_elastic.controller.main import unplaceable_floor

    config = parse_config({"workers": {"command": "w"}, "autoscaler": {"min_workers": floor, "max_workers": floor}})
    gpus = {"node1": (0, 1, 2, 3), "node2": (0, 1, 2, 3)}
    assert says in unplaceable_floor(config, gpus, "node2")
    assert "hold at most 7" in unplaceable_floor(config, gpus, "elsewhere")  # the first node's, then
    if floor == 8:  # the trainer on the node with a fifth GPU: 8 fit
        assert unplaceable_floor(config, {**gpus, "node2": (0, 1, 2, 3, 4)}, "node2") == ""
