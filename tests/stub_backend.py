"""A Slurm backend for in-process controller tests and timings: it lists the steps it is given,
describes the job as running on ``job_nodes`` (none: the allocation the controller was given)
and accepts every action. Only for what does not touch Slurm; the adapter itself is tested on
the dev cluster."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.slurm.backend import StepSpec
from slurm_elastic.slurm.parse import JobInfo, NodeState, StepInfo


class ListedSteps:
    name = "listed"

    def __init__(self, steps: list[StepInfo] | None = None) -> None:
        self.steps: list[StepInfo] = list(steps or [])
        self.job_nodes: tuple[str, ...] = ()
        self.job_info_calls = 0
        self.comment = ""
        self.nodes: dict[str, NodeState] = {}  # node states Slurm reports (none: every node as usual)

    def set_job_comment(self, job_id: int, comment: str) -> None:
        self.comment = comment

    def job_info(self, job_id: int) -> JobInfo:
        self.job_info_calls += 1
        return JobInfo(job_id, "train", "RUNNING", self.job_nodes, (self.job_nodes or ("",))[0], self.comment, "me", "gpu")

    def node_states(self, nodes: list[str]) -> dict[str, NodeState]:
        return {name: self.nodes.get(name, NodeState(name, "mixed")) for name in nodes}

    def list_steps(self, job_id: int) -> list[StepInfo]:
        return list(self.steps)

    def launch_step(self, spec: StepSpec, launcher_log: Path) -> int:
        return 0

    def signal_step(self, job_id: int, step_id: str, signal_name: str) -> None:
        pass

    def cancel_step(self, job_id: int, step_id: str) -> None:
        pass


def run_workers(controller: Any, backend: ListedSteps, count: int, node: str = "node1") -> None:
    """Workers 0001..000<count> running on ``node``'s GPUs 0..count-1 (step ids 1..count): listed by
    Slurm and registered, as after their launch."""
    for number in range(1, count + 1):
        backend.steps.append(StepInfo(1, str(number), worker_step_name(f"{number:04d}"), (node,), "0:01", "",
                                      "gres/gpu:1", 1))
        controller.register_worker(f"{number:04d}", {"node": node, "gpus": [number - 1], "step_id": str(number)})


@contextlib.contextmanager
def lock_held_elsewhere(lock: Any) -> Iterator[threading.Event]:
    """``lock`` held by another thread, as a tick holds the controller's, until the event yielded is
    set or the block ends."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(30)
    try:
        yield release
    finally:
        release.set()
        holder.join(30)
