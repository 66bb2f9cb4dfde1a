"""What the controller needs from Slurm, as one small interface with a CLI and a pyslurm backend."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from slurm_elastic.slurm.parse import JobInfo, StepInfo


@dataclass(frozen=True)
class StepSpec:
    """A job step to launch inside an existing allocation."""

    job_id: int
    name: str
    argv: tuple[str, ...]
    output_path: Path
    gpus: int = 1
    cpus: int = 1
    mem_mb: int = 0  # 0: no explicit --mem (the partition's default per CPU applies)
    nodelist: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)  # added to srun's environment (any characters)
    overlap: bool = False  # share resources with other steps (node agents), else --exact
    extra_args: tuple[str, ...] = ()


def build_srun_argv(spec: StepSpec) -> list[str]:
    """The ``srun`` command line for ``spec`` (pure; golden-tested)."""
    argv = [
        "srun",
        f"--jobid={spec.job_id}",
        f"--job-name={spec.name}",
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={spec.cpus}",
        "--overlap" if spec.overlap else "--exact",
        "--input=none",
        f"--output={spec.output_path}",
        "--kill-on-bad-exit=1",
    ]
    if spec.gpus:
        argv.append(f"--gres=gpu:{spec.gpus}")
    if spec.mem_mb:
        argv.append(f"--mem={spec.mem_mb}M")
    if spec.nodelist:
        argv.append(f"--nodelist={','.join(spec.nodelist)}")
    if spec.exclude:
        argv.append(f"--exclude={','.join(spec.exclude)}")
    argv.append("--export=ALL")  # spec.env reaches the step through srun's own environment
    argv.extend(spec.extra_args)
    argv.append("--")
    argv.extend(spec.argv)
    return argv


class SlurmBackend(Protocol):
    """The Slurm operations slurm-elastic uses. Every method makes at most one Slurm call."""

    name: str

    def list_steps(self, job_id: int) -> list[StepInfo]:
        """All running steps of ``job_id`` (one batched call). Raises if the job is unknown."""
        ...

    def job_info(self, job_id: int) -> JobInfo:
        """The job's state, nodes, batch host and comment. Raises SlurmError if unknown."""
        ...

    def launch_step(self, spec: StepSpec, launcher_log: Path) -> int:
        """Start ``srun`` detached (own session); returns the launcher's pid."""
        ...

    def signal_step(self, job_id: int, step_id: str, signal_name: str) -> None:
        """Send a signal (``USR1``, ``USR2``, ``TERM``...) to every task of a step."""
        ...

    def cancel_step(self, job_id: int, step_id: str) -> None:
        """Cancel a step (SIGTERM, then SIGKILL after Slurm's KillWait)."""
        ...
