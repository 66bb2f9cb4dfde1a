"""Optional backend through pyslurm (the Slurm C API), used only when it matches the running Slurm.

pyslurm on PyPI binds to exactly one Slurm release (its MAJOR.MINOR is Slurm's). Importing it
calls ``slurm_init()``, which *exits the whole process* when no configuration is reachable, so
the selection probes it in a child process first, and the backend imports it with
``PYSLURM_DISABLE_AUTO_INIT=1`` and initialises it explicitly.

What pyslurm cannot do, and what we do instead:
- a step's GPUs: ``JobStep.tres_per_node`` is always None (pyslurm parses ``gres/gpu:1`` as
  ``key=value`` and finds nothing), and the step's allocated TRES names ``gres/gpu`` only where
  Slurm accounts it (``AccountingStorageTRES=gres/gpu``, which needs slurmdbd). Where it is
  accounted, steps are listed through pyslurm alone; elsewhere the listing is one
  ``squeue --steps`` call, so the trainer's GPUs are always counted.
- a step that was not loaded drops ``send_signal`` silently: steps are always loaded first.
- a step whose TRES has ``mem=0`` makes ``JobStep.tres`` raise TypeError: read as "no GPUs seen".
- launching a step: always ``srun`` (pyslurm has no step launch); burst jobs: ``sbatch``,
  ``squeue`` and ``scancel`` (a rendered script's ``#SBATCH`` lines are not pyslurm's to read).

The conversions from pyslurm's values to our types are pure functions, tested on recorded values.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.backend import (
    PyslurmProbe,
    SlurmBackend,
    StepSpec,
    choose_backend,
    parse_slurm_version,
    step_signal_name,
)
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.parse import (
    JobInfo,
    NodeState,
    QueuedJob,
    StepInfo,
    ended_exit_code,
    expand_hostlist,
    output_file,
    slurm_reason,
)
from slurm_elastic.slurm.runner import run_command

log = logging.getLogger(__name__)

GPU_TRES = "gres/gpu"

# Runs in a child process: a missing or broken pyslurm, or an unreachable slurmctld, can never
# take the caller down. Prints one JSON line.
_PROBE = """
import json, os, sys
os.environ["PYSLURM_DISABLE_AUTO_INIT"] = "1"
out = {"pyslurm": "", "slurmctld": "", "gpu_tres_accounted": False, "error": ""}
try:
    import pyslurm
    out["pyslurm"] = str(getattr(pyslurm, "__version__", ""))
    pyslurm.api.slurm_init(os.environ.get("SLURM_CONF") or None)
    config = pyslurm.slurmctld.Config.load()
    out["slurmctld"] = str(config.version or "")
    out["gpu_tres_accounted"] = "gres/gpu" in (config.accounting_storage_tres or [])
except ImportError as exc:
    out["error"] = "not installed (" + str(exc) + ")"
except Exception as exc:
    out["error"] = type(exc).__name__ + ": " + str(exc)
print(json.dumps(out))
"""


# ---- pure conversions (pyslurm values -> our types) ---------------------------------------------
def parse_index_list(text: str) -> tuple[int, ...]:
    """GPU indexes from pyslurm's layout string: ``0-1``, ``0,2-3``; ``()`` for none."""
    indexes: list[int] = []
    for part in str(text or "").split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            continue
        indexes.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(set(indexes)))


def gpus_by_node_from_layout(layout: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Node -> the job's GPU indexes there, from ``Job.get_resource_layout_per_node()``.

    ``{'node1': {'gres': {'gpu': {'count': 2, 'indexes': '0-1'}}}}`` gives ``{'node1': (0, 1)}``;
    typed GPUs (``gpu:a100``) count as GPUs; a node without GPUs maps to ``()``.
    """
    out: dict[str, tuple[int, ...]] = {}
    for node, detail in layout.items():
        gres = detail.get("gres") if isinstance(detail, Mapping) else None
        indexes: set[int] = set()
        for name, item in (gres or {}).items():
            if (name == "gpu" or str(name).startswith("gpu:")) and isinstance(item, Mapping):
                indexes.update(parse_index_list(str(item.get("indexes", ""))))
        out[str(node)] = tuple(sorted(indexes))
    return out


def job_info_from_pyslurm(job_id: int, fields: Mapping[str, Any]) -> JobInfo:
    """A JobInfo from a pyslurm Job's values (``state``, ``allocated_nodes``, ..., ``layout``)."""
    nodes = fields.get("allocated_nodes")
    node_list = list(nodes) if isinstance(nodes, (list, tuple)) else expand_hostlist(str(nodes or ""))
    return JobInfo(
        job_id=job_id, name=str(fields.get("name") or ""), state=str(fields.get("state") or ""),
        nodes=tuple(node_list), batch_host=str(fields.get("batch_host") or ""),
        comment=str(fields.get("comment") or ""), user_name=str(fields.get("user_name") or ""),
        partition=str(fields.get("partition") or ""),
        gpus_by_node=gpus_by_node_from_layout(fields.get("layout") or {}),
        cluster=str(fields.get("cluster") or ""), submit_time_s=int(fields.get("submit_time") or 0),
        restart_count=int(fields.get("requeue_count") or 0),
        start_time_s=int(fields.get("start_time") or 0), end_time_s=int(fields.get("end_time") or 0),
        exit_code=ended_exit_code(str(fields.get("state") or ""), code if isinstance(code := fields.get("exit_code"), int)
                                  and not fields.get("exit_code_signal") else None),
        output=output_file(str(fields.get("standard_output") or ""), job_id,
                           "" if fields.get("array_id") else str(fields.get("working_directory") or "")),
        reason=slurm_reason(fields.get("state_reason")),
    )


def gpu_tres_per_node(gres_counts: Mapping[str, int], node_count: int) -> str:
    """``gres/gpu:N`` per node from a step's allocated GRES counts, ``""`` when it holds no GPU.

    Slurm lists both the total (``gpu``) and each type (``gpu:a100``); the total wins, else the
    types are summed. Allocated TRES are for the whole step: divided evenly over its nodes.
    """
    total = gres_counts.get("gpu")
    if total is None:
        total = sum(n for name, n in gres_counts.items() if name.startswith("gpu:"))
    per_node = int(total) // max(1, node_count)
    return f"{GPU_TRES}:{per_node}" if per_node > 0 else ""


def slurm_duration(seconds: int) -> str:
    """Seconds as squeue prints a time (``%M``): ``0:07``, ``12:03``, ``1:02:03``, ``2-01:02:03``."""
    days, rest = divmod(max(0, int(seconds)), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"


def step_info_from_pyslurm(job_id: int, step_key: object, fields: Mapping[str, Any]) -> StepInfo:
    """A StepInfo from a pyslurm JobStep's values; ``gres`` is its allocated GRES counts."""
    nodes = fields.get("allocated_nodes")
    node_list = tuple(nodes) if isinstance(nodes, (list, tuple)) else tuple(expand_hostlist(str(nodes or "")))
    start = fields.get("start_time")
    return StepInfo(
        job_id=job_id, step_id=str(step_key), name=str(fields.get("name") or ""), nodes=node_list,
        time_used=slurm_duration(int(fields.get("run_time") or 0)),
        start_time=datetime.fromtimestamp(int(start)).strftime("%Y-%m-%dT%H:%M:%S") if start else "",
        tres_per_node=gpu_tres_per_node(fields.get("gres") or {}, len(node_list)),
        num_tasks=int(fields.get("ntasks") or 0),
    )


# ---- the backend ---------------------------------------------------------------------------------
def node_state_from_pyslurm(name: str, state: str | None, reason: str | None) -> NodeState:
    """pyslurm's ``Node.state`` (``MIXED+DRAIN``) and ``Node.reason`` as the CLI backend reads them."""
    return NodeState(name, (state or "unknown").lower(), (reason or "").strip())


def _allocated_gres(step: Any) -> dict[str, int]:
    """The step's allocated GRES counts; {} where pyslurm cannot parse its TRES (``mem=0``)."""
    try:
        tres = step.tres
    except (TypeError, ValueError):
        return {}
    return {str(name): int(item.count or 0) for name, item in (tres.gres if tres else {}).items()}


def _step_fields(step: Any) -> dict[str, Any]:
    return {"name": step.name, "allocated_nodes": step.allocated_nodes, "ntasks": step.ntasks,
            "start_time": step.start_time, "run_time": step.run_time, "gres": _allocated_gres(step)}


class PySlurm:
    """Jobs, signals and cancels through pyslurm; steps through pyslurm where Slurm accounts
    their GPUs (else one ``squeue --steps``); launches through srun."""

    name = "pyslurm"

    def __init__(self, conf_path: str | None = None, *, steps_through_api: bool | None = None) -> None:
        os.environ["PYSLURM_DISABLE_AUTO_INIT"] = "1"
        import pyslurm

        pyslurm.api.slurm_init(conf_path or os.environ.get("SLURM_CONF") or None)
        self._pyslurm: Any = pyslurm
        self._cli = SlurmCli()
        if steps_through_api is None:
            accounted = pyslurm.slurmctld.Config.load().accounting_storage_tres or []
            steps_through_api = GPU_TRES in accounted
        self.steps_through_api = steps_through_api

    def list_steps(self, job_id: int) -> list[StepInfo]:
        if not self.steps_through_api:
            return self._cli.list_steps(job_id)
        try:
            steps = self._pyslurm.JobSteps.load(int(job_id))
        except Exception as exc:  # pyslurm raises its own RPCError family
            if "Invalid job id" in str(exc):
                return []
            raise SlurmError(f"listing steps of job {job_id} failed: {exc}") from None
        return [step_info_from_pyslurm(job_id, key, _step_fields(step)) for key, step in steps.items()]

    def list_steps_of(self, job_ids: Sequence[int]) -> list[StepInfo]:
        if not self.steps_through_api:
            return self._cli.list_steps_of(job_ids)
        return [step for job_id in job_ids for step in self.list_steps(job_id)]

    def job_info(self, job_id: int) -> JobInfo:
        try:
            job = self._pyslurm.Job.load(int(job_id))
        except Exception as exc:
            raise SlurmError(f"job {job_id} is unknown to Slurm (finished long ago, or never existed): {exc}") from None
        try:
            layout = job.get_resource_layout_per_node() or {}
        except Exception:  # a pending or finished job has no layout
            layout = {}
        fields = {key: getattr(job, key, None) for key in
                  ("name", "state", "allocated_nodes", "batch_host", "comment", "user_name", "partition",
                   "cluster", "submit_time", "requeue_count", "start_time", "end_time", "exit_code",
                   "exit_code_signal", "standard_output", "working_directory", "array_id", "state_reason")}
        return job_info_from_pyslurm(job_id, {**fields, "layout": layout})

    def node_states(self, nodes: Sequence[str]) -> dict[str, NodeState]:
        if not nodes:
            return {}
        try:
            loaded = self._pyslurm.Nodes.load()
        except Exception as exc:
            raise SlurmError(f"loading the nodes failed: {exc}") from None
        wanted = set(nodes)
        return self._cli.with_maintenance_reasons({name: node_state_from_pyslurm(name, node.state, node.reason)
                                                   for name, node in loaded.items() if name in wanted})

    def launch_step(self, spec: StepSpec, launcher_log: Path) -> int:
        return self._cli.launch_step(spec, launcher_log)

    def signal_step(self, job_id: int, step_id: str, signal_name: str) -> None:
        name = step_signal_name(signal_name)
        step = self._load_step(job_id, step_id)  # an unloaded step object drops the signal
        if step is not None:
            step.send_signal(f"SIG{name}")

    def cancel_step(self, job_id: int, step_id: str) -> None:
        step = self._load_step(job_id, step_id)
        if step is not None:
            step.cancel()

    # Burst jobs go through the CLI: they are rendered batch scripts whose options are #SBATCH
    # lines, which pyslurm's JobSubmitDescription does not read.
    def submit_batch(self, script: Path) -> int:
        return self._cli.submit_batch(script)

    def list_jobs_named(self, name: str, user: str | None = None) -> list[QueuedJob]:
        return self._cli.list_jobs_named(name, user)

    def list_my_jobs(self) -> list[QueuedJob]:
        return self._cli.list_my_jobs()

    def list_jobs(self, job_ids: Sequence[int]) -> list[QueuedJob]:
        return self._cli.list_jobs(job_ids)

    def shrink_job(self, job_id: int, nodes: Sequence[str]) -> None:
        self._cli.shrink_job(job_id, nodes)

    def set_job_name(self, job_id: int, name: str) -> None:
        self._cli.set_job_name(job_id, name)

    def cancel_job(self, job_id: int) -> None:
        self._cli.cancel_job(job_id)

    def set_job_comment(self, job_id: int, comment: str) -> None:
        self._cli.set_job_comment(job_id, comment)

    def _load_step(self, job_id: int, step_id: str) -> Any:
        """The loaded step, or None when it no longer exists (it ended: nothing to signal)."""
        key: int | str = int(step_id) if step_id.isdigit() else step_id
        try:
            return self._pyslurm.JobStep.load(int(job_id), key)
        except Exception as exc:
            if "not found" in str(exc) or "Invalid job id" in str(exc):
                return None
            raise SlurmError(f"loading step {job_id}.{step_id} failed: {exc}") from None


# ---- selection ------------------------------------------------------------------------------------
def running_slurm_version() -> tuple[int, int] | None:
    """(major, minor) of the Slurm commands on PATH (``scontrol --version``), which launch the steps."""
    try:
        return parse_slurm_version(run_command(["scontrol", "--version"], timeout_s=10).stdout)
    except SlurmError:
        return None


def probe_pyslurm(python: str = sys.executable, timeout_s: float = 30.0) -> PyslurmProbe:
    """pyslurm's version and what it sees of slurmctld, found in a child process (never kills us)."""
    try:
        proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s,
                              check=False, env={**os.environ, "PYSLURM_DISABLE_AUTO_INIT": "1"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return PyslurmProbe(error=f"probe failed: {exc}")
    try:
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        detail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return PyslurmProbe(error=f"import failed: {detail}")
    return PyslurmProbe(
        pyslurm_version=parse_slurm_version(str(data.get("pyslurm", ""))),
        controller_version=parse_slurm_version(str(data.get("slurmctld", ""))),
        gpu_tres_accounted=bool(data.get("gpu_tres_accounted")),
        error=str(data.get("error", "")),
    )


def select_backend(preference: str = "auto") -> SlurmBackend:
    """``cli`` unless pyslurm matches the running Slurm (``auto``) or is asked for; logs why."""
    if preference == "cli":
        log.info("Slurm backend: cli (as configured)")
        return SlurmCli()
    choice = choose_backend(preference, running_slurm_version(), probe_pyslurm())
    if choice.name == "pyslurm":
        try:
            backend = PySlurm(steps_through_api=choice.steps_through_api)
        except Exception as exc:
            if preference == "pyslurm":
                raise SlurmError(f"the pyslurm backend failed to initialise: {exc}") from None
            log.warning("Slurm backend: cli (pyslurm failed to initialise: %s)", exc)
            return SlurmCli()
        log.info("Slurm backend: pyslurm (%s)", choice.reason)
        return backend
    log.info("Slurm backend: cli (%s)", choice.reason)
    return SlurmCli()
