"""A worker step cancelled by someone else than the controller (``scancel J.S``): Slurm's CANCELLED
line in the step's output marks it, and the worker is relaunched without a crash on its GPU. The
real scancel is in tests/cluster/test_operator_scancel.py."""

from __future__ import annotations

from pathlib import Path

from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller, step_output_says_cancelled
from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.slurm.parse import StepInfo
from tests.stub_backend import ListedSteps

CANCELLED = "slurmstepd-node1: error: *** STEP 7.3 ON node1 CANCELLED AT 2026-11-26T05:23:19 ***\n"


def test_the_cancelled_line_of_this_step_and_no_other(tmp_path: Path) -> None:
    out = tmp_path / "worker-0001.out"
    assert not step_output_says_cancelled(out, "7.3")  # no output at all
    out.write_text("x" * 10_000 + "\n" + CANCELLED)
    assert step_output_says_cancelled(out, "7.3")
    assert not step_output_says_cancelled(out, "7.30") and not step_output_says_cancelled(out, "8.3")


def test_a_step_cancelled_by_hand_is_relaunched_and_not_counted(tmp_path: Path) -> None:
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    backend = ListedSteps()
    controller = Controller(config, 7, backend, tmp_path, gpus_by_node={"node1": (0, 1)})  # type: ignore[arg-type]
    controller.scale(1)
    controller.tick()
    (worker_id,) = controller.workers
    backend.steps = [StepInfo(7, "3", worker_step_name(worker_id), ("node1",), "0:01", "", "gres/gpu:1", 1)]
    controller.tick()
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "logs" / f"worker-{worker_id}.out").write_text(CANCELLED)
    backend.steps = []

    controller.tick()

    worker = controller.workers[worker_id]
    assert worker.crash_count == 0 and worker.launches == 2 and controller.cordoned_gpus() == {}
    assert "stopped from outside" in worker.history[-3][3]
