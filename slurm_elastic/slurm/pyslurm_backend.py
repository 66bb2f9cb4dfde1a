"""Optional read/signal backend through pyslurm, used only when it matches the running Slurm.

pyslurm on PyPI binds to exactly one Slurm release (its MAJOR.MINOR is Slurm's). Importing it
calls ``slurm_init()``, which *exits the whole process* when no configuration is reachable, so
we (1) probe it in a subprocess first, and (2) import it with ``PYSLURM_DISABLE_AUTO_INIT=1``
and initialise explicitly. Two upstream bugs are worked around: a step object that was not
loaded silently drops ``send_signal`` (we always ``JobStep.load`` first), and per-step GPU
indexes are not readable without slurmdbd (we do not read them from pyslurm). Launching steps
always goes through ``srun`` (pyslurm has no step launch).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.backend import SlurmBackend, StepSpec
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.parse import JobInfo, StepInfo, expand_hostlist
from slurm_elastic.slurm.runner import run_command

log = logging.getLogger(__name__)

_PROBE = (
    "import os; os.environ['PYSLURM_DISABLE_AUTO_INIT'] = '1'; import pyslurm; "
    "print(getattr(pyslurm, '__version__', '') or pyslurm.version())"
)


def running_slurm_version() -> tuple[int, int] | None:
    """(major, minor) of the Slurm on PATH, from ``scontrol --version`` (``slurm 22.05.8``)."""
    try:
        text = run_command(["scontrol", "--version"], timeout_s=10).stdout
    except SlurmError:
        return None
    match = re.search(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def probe_pyslurm_version(python: str = sys.executable) -> tuple[int, int] | None:
    """pyslurm's (major, minor) if it imports in a child process, else None (never kills us)."""
    try:
        proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.match(r"(\d+)\.(\d+)", proc.stdout.strip())
    if proc.returncode != 0 or not match:
        return None
    return int(match.group(1)), int(match.group(2))


class PySlurm:
    """Reads and signals through pyslurm; launches through srun."""

    name = "pyslurm"

    def __init__(self) -> None:
        os.environ["PYSLURM_DISABLE_AUTO_INIT"] = "1"
        import pyslurm

        init = getattr(getattr(pyslurm, "api", None), "slurm_init", None) or getattr(pyslurm, "slurm_init", None)
        if init is not None:
            init(os.environ.get("SLURM_CONF"))
        self._pyslurm: Any = pyslurm
        self._cli = SlurmCli()

    def list_steps(self, job_id: int) -> list[StepInfo]:
        try:
            steps = self._pyslurm.JobSteps.load(job_id)
        except Exception as exc:  # pyslurm raises its own RPCError family
            raise SlurmError(f"listing steps of job {job_id} failed: {exc}") from None
        out = []
        for step_id, step in steps.items():
            nodes = step.allocated_nodes
            node_list = tuple(nodes) if isinstance(nodes, list) else tuple(expand_hostlist(str(nodes or "")))
            out.append(
                StepInfo(
                    job_id=job_id, step_id=str(step_id), name=str(step.name or ""), nodes=node_list,
                    time_used="", start_time="", tres_per_node="", num_tasks=int(step.ntasks or 0),
                )
            )
        return out

    def job_info(self, job_id: int) -> JobInfo:
        try:
            job = self._pyslurm.Job.load(job_id)
        except Exception as exc:
            raise SlurmError(f"job {job_id} is unknown to Slurm: {exc}") from None
        nodes = job.allocated_nodes
        return JobInfo(
            job_id=job_id, name=str(job.name or ""), state=str(job.state or ""),
            nodes=tuple(expand_hostlist(str(nodes or ""))), batch_host=str(getattr(job, "batch_host", "") or ""),
            comment=str(getattr(job, "comment", "") or ""), user_name=str(getattr(job, "user_name", "") or ""),
            partition=str(getattr(job, "partition", "") or ""), cluster=str(getattr(job, "cluster", "") or ""),
            submit_time_s=int(getattr(job, "submit_time", 0) or 0),
            restart_count=int(getattr(job, "requeue_count", getattr(job, "restart_cnt", 0)) or 0),
        )

    def launch_step(self, spec: StepSpec, launcher_log: Path) -> int:
        return self._cli.launch_step(spec, launcher_log)

    def signal_step(self, job_id: int, step_id: str, signal_name: str) -> None:
        step = self._load_step(job_id, step_id)  # an unloaded step object drops the signal
        step.send_signal("SIG" + signal_name.upper().removeprefix("SIG"))

    def cancel_step(self, job_id: int, step_id: str) -> None:
        self._load_step(job_id, step_id).cancel()

    def _load_step(self, job_id: int, step_id: str) -> Any:
        key: int | str = int(step_id) if step_id.isdigit() else step_id
        try:
            return self._pyslurm.JobStep.load(job_id, key)
        except Exception as exc:
            raise SlurmError(f"step {job_id}.{step_id} not found: {exc}") from None


def select_backend(preference: str = "auto") -> SlurmBackend:
    """``cli`` (the default everywhere), or ``pyslurm`` when asked for/auto and it matches Slurm."""
    if preference not in ("auto", "cli", "pyslurm"):
        raise SlurmError(f"unknown Slurm backend {preference!r}: choose auto, cli or pyslurm")
    if preference == "cli":
        log.info("Slurm backend: cli (as configured)")
        return SlurmCli()
    wanted = running_slurm_version()
    found = probe_pyslurm_version()
    if found is not None and wanted is not None and found == wanted:
        try:
            backend = PySlurm()
        except Exception as exc:
            log.warning("Slurm backend: cli (pyslurm %s.%s failed to initialise: %s)", *found, exc)
            return SlurmCli()
        log.info("Slurm backend: pyslurm %s.%s (matches Slurm %s.%s)", *found, *wanted)
        return backend
    why = "not installed" if found is None else f"pyslurm {found[0]}.{found[1]} does not match Slurm {wanted}"
    if preference == "pyslurm":
        raise SlurmError(f"the pyslurm backend was asked for, but {why}")
    log.info("Slurm backend: cli (pyslurm %s)", why)
    return SlurmCli()
