"""What the controller needs from Slurm, as one small interface with a CLI and a pyslurm backend."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from slurm_elastic.core.signals import signal_name
from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.parse import JobInfo, NodeState, QueuedJob, StepInfo


@dataclass(frozen=True)
class StepSpec:
    """A job step to launch inside an existing allocation."""

    job_id: int
    name: str
    argv: tuple[str, ...]
    output_path: Path
    gpus: int = 1  # per node
    cpus: int = 1  # per task
    nodes: int = 1
    tasks_per_node: int = 1
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
        f"--nodes={spec.nodes}",
        f"--ntasks={spec.nodes * spec.tasks_per_node}",
        f"--cpus-per-task={spec.cpus}",
        "--overlap" if spec.overlap else "--exact",
        "--input=none",
        f"--output={spec.output_path}",
        "--open-mode=append",  # a relaunch keeps what the earlier step wrote (its crash)
        "--kill-on-bad-exit=1",
    ]
    if spec.nodes > 1 or spec.tasks_per_node > 1:
        argv.append(f"--ntasks-per-node={spec.tasks_per_node}")
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
        """All running steps of ``job_id`` (one batched call), each with its GPUs per node in
        ``tres_per_node`` (``gres/gpu:N``); ``[]`` for an unknown job. Raises if Slurm does not answer."""
        ...

    def list_steps_of(self, job_ids: Sequence[int]) -> list[StepInfo]:
        """All running steps of several jobs (the controller's and its burst jobs) in one call."""
        ...

    def job_info(self, job_id: int) -> JobInfo:
        """The job's state, nodes, batch host and comment. Raises SlurmError if unknown."""
        ...

    def set_job_comment(self, job_id: int, comment: str) -> None:
        """Set the job's comment (``scontrol update``). Raises SlurmError if Slurm refuses."""
        ...

    def node_states(self, nodes: Sequence[str]) -> dict[str, NodeState]:
        """The state and reason of each of ``nodes`` that Slurm knows (one call). Raises if Slurm
        does not answer."""
        ...

    def launch_step(self, spec: StepSpec, launcher_log: Path) -> int:
        """Start ``srun`` detached (own session); returns the launcher's pid."""
        ...

    def signal_step(self, job_id: int, step_id: str, signal_name: str) -> None:
        """Send a signal (``USR1``, ``USR2``, ``TERM``...) to every task of a step; a step that
        has ended already is no error (the next listing shows it gone)."""
        ...

    def cancel_step(self, job_id: int, step_id: str) -> None:
        """Cancel a step (SIGTERM, then SIGKILL after Slurm's KillWait); an ended step is no error."""
        ...

    def submit_batch(self, script: Path) -> int:
        """Submit a batch script (its options in ``#SBATCH`` lines); returns the new job's id.
        Raises SlurmCommandError with sbatch's message if Slurm refuses it."""
        ...

    def list_jobs_named(self, name: str, user: str | None = None) -> list[QueuedJob]:
        """The jobs of ``user`` (None: this user) named ``name`` that Slurm still lists (pending,
        running, completing), with state, nodes, GPUs per node, pending reason and (expected) start.
        One call."""
        ...

    def list_my_jobs(self) -> list[QueuedJob]:
        """Every job of this user that Slurm still lists, as :meth:`list_jobs_named` describes them.
        One call; its answer grows with the user's jobs, so it is for rare use (a controller's start)."""
        ...

    def list_jobs(self, job_ids: Sequence[int]) -> list[QueuedJob]:
        """Those of ``job_ids`` that Slurm still lists, as :meth:`list_jobs_named` describes them;
        unknown and ended ones are left out. One call."""
        ...

    def shrink_job(self, job_id: int, nodes: Sequence[str]) -> None:
        """Keep only ``nodes`` in the running job (``scontrol update JobId=J NodeList=...``): the
        others go back to Slurm and their steps end. Raises SlurmError if Slurm refuses."""
        ...

    def set_job_name(self, job_id: int, name: str) -> None:
        """Set the job's name (``scontrol update``). Raises SlurmError if Slurm refuses."""
        ...

    def cancel_job(self, job_id: int) -> None:
        """Cancel a whole job, pending or running; an ended or unknown job is no error."""
        ...


def parse_slurm_version(text: str) -> tuple[int, int] | None:
    """(major, minor) from ``slurm 25.11.7``, ``slurm-wlm 22.05.8``, ``25.11.2``; None if absent."""
    match = re.search(r"\b(\d+)\.(\d+)(?:\.\d+)?\b", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


@dataclass(frozen=True)
class PyslurmProbe:
    """What a child process found of pyslurm: its version, slurmctld's, or why it failed."""

    pyslurm_version: tuple[int, int] | None = None
    controller_version: tuple[int, int] | None = None
    gpu_tres_accounted: bool = False  # AccountingStorageTRES names gres/gpu: steps' GPUs readable
    error: str = ""


@dataclass(frozen=True)
class BackendChoice:
    """Which backend to use, and why (logged)."""

    name: Literal["cli", "pyslurm"]
    reason: str
    steps_through_api: bool = False


def _dotted(version: tuple[int, int] | None) -> str:
    return "unknown" if version is None else f"{version[0]}.{version[1]:02d}"


def choose_backend(preference: str, slurm_version: tuple[int, int] | None,
                   probe: PyslurmProbe) -> BackendChoice:
    """The selection rule (pure). ``cli`` is the default; pyslurm is used (``auto``, or when asked
    for) only if it imports, reaches slurmctld, and its MAJOR.MINOR equals both slurmctld's and
    that of the Slurm commands on PATH (which launch the steps). Asking for ``pyslurm`` when it
    does not qualify raises SlurmError with the reason."""
    if preference not in ("auto", "cli", "pyslurm"):
        raise SlurmError(f"unknown Slurm backend {preference!r}: choose auto, cli or pyslurm")
    if preference == "cli":
        return BackendChoice("cli", "as configured")
    found, ctld = probe.pyslurm_version, probe.controller_version
    if found is None:
        why = f"pyslurm {probe.error or 'is not installed'}"
    elif probe.error and slurm_version is not None and slurm_version != found:  # the usual cause: another release
        why = (f"pyslurm {_dotted(found)} does not match the Slurm commands on PATH ({_dotted(slurm_version)}), "
               f"and cannot reach slurmctld: {probe.error}")
    elif probe.error:
        why = f"pyslurm {_dotted(found)} cannot reach slurmctld: {probe.error}"
    elif ctld != found:
        why = f"pyslurm {_dotted(found)} does not match slurmctld {_dotted(ctld)}"
    elif slurm_version != found:
        why = f"pyslurm {_dotted(found)} does not match the Slurm commands on PATH ({_dotted(slurm_version)})"
    else:
        steps = ("steps through the API" if probe.gpu_tres_accounted else
                 "steps through squeue: Slurm does not account gres/gpu, so the API cannot see a step's GPUs")
        return BackendChoice("pyslurm", f"pyslurm {_dotted(found)} matches Slurm; {steps}",
                             steps_through_api=probe.gpu_tres_accounted)
    if preference == "pyslurm":
        raise SlurmError(f"the pyslurm backend was asked for, but {why}")
    return BackendChoice("cli", why)


def step_signal_name(raw: str) -> str:
    """A signal for ``signal_step`` (``USR1``, ``sigstop``...) as Slurm names it; SlurmError if unknown."""
    name = signal_name(raw)
    if name is None:
        raise SlurmError(f"not a signal name: {raw!r}")
    return name
