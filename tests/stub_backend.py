"""A Slurm backend for in-process controller tests and timings: it lists the steps it is given
and accepts every action. Only for what does not touch Slurm; the adapter itself is tested on
the dev cluster."""

from __future__ import annotations

from pathlib import Path

from slurm_elastic.slurm.backend import StepSpec
from slurm_elastic.slurm.parse import StepInfo


class ListedSteps:
    name = "listed"

    def __init__(self, steps: list[StepInfo] | None = None) -> None:
        self.steps: list[StepInfo] = list(steps or [])

    def list_steps(self, job_id: int) -> list[StepInfo]:
        return list(self.steps)

    def launch_step(self, spec: StepSpec, launcher_log: Path) -> int:
        return 0

    def signal_step(self, job_id: int, step_id: str, signal_name: str) -> None:
        pass

    def cancel_step(self, job_id: int, step_id: str) -> None:
        pass
