"""Records of workers that ended are kept an hour (ENDED_KEPT_S), in memory as in state.json: a job
that scales all week does not tick over, hold and save every worker it ever had."""

from __future__ import annotations

from pathlib import Path

from slurm_elastic.controller.base import ENDED_KEPT_S
from slurm_elastic.core.lifecycle import WorkerState, transition
from tests.unit.test_busy_time import Clock, controller_with_two_workers


def test_a_worker_that_ended_an_hour_ago_is_forgotten(tmp_path: Path) -> None:
    clock = Clock()
    controller = controller_with_two_workers(tmp_path, clock)
    transition(controller.state.workers["0001"], WorkerState.INACTIVE, clock(), "exited cleanly")
    controller.save()
    clock.now_s += ENDED_KEPT_S - 1
    controller.forget_ended()
    assert "0001" in controller.state.workers  # still within the hour: status and state.json show it
    clock.now_s += 1
    controller.forget_ended()
    assert "0001" not in controller.state.workers and "0002" in controller.state.workers
    controller.save()
    assert set(controller.state_file.load().workers) == {"0002"}
