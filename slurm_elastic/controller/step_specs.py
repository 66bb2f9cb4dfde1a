"""The ``srun`` step specs the controller launches: worker steps and node agents; and the GPUs the
job's other steps hold, read from Slurm's listing."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from slurm_elastic.controller.config import ElasticConfig
from slurm_elastic.controller.worker_env import worker_settings_env
from slurm_elastic.core.naming import AGENT_PREFIX, worker_id_of_step, worker_step_name
from slurm_elastic.core.shape import WorkerShape
from slurm_elastic.slurm.backend import StepSpec
from slurm_elastic.slurm.parse import StepInfo


def worker_step_spec(config: ElasticConfig, job_id: int, worker_id: str, exclude: tuple[str, ...], *,
                     controller_url: str, state_dir: Path, token_file: Path | None,
                     shape: WorkerShape | None = None) -> StepSpec:
    """One worker step in job ``job_id``: the worker wrapper around the configured command, on
    ``shape.nodes`` nodes (one endpoint: task 0's) with ``shape.gpus_per_node`` GPUs on each."""
    w = config.workers
    shape = shape or WorkerShape(1, w.gpus_per_worker, w.tasks_per_node)
    values = {"worker_id": worker_id, "gpus": str(w.gpus_per_worker), "nodes": str(shape.nodes),
              "controller_url": controller_url,
              "job_id": str(job_id), "state_dir": str(state_dir)}
    command = [_render(part, values) for part in w.command]
    env = {
        **w.env,
        "SLURM_ELASTIC_CONTROLLER_URL": controller_url,
        "SLURM_ELASTIC_WORKER_ID": worker_id,
        "SLURM_ELASTIC_STATE_DIR": str(state_dir),
        **worker_settings_env(w),
    }
    if token_file is not None:
        env["SLURM_ELASTIC_TOKEN_FILE"] = str(token_file)
    return StepSpec(
        job_id=job_id, name=worker_step_name(worker_id),
        argv=(sys.executable, "-m", "slurm_elastic", "worker", "--", *command),
        output_path=state_dir / "logs" / f"worker-{worker_id}.out",
        gpus=shape.gpus_per_node, cpus=w.cpus_per_worker, mem_mb=w.mem_per_worker_mb,
        nodes=shape.nodes, tasks_per_node=shape.tasks_per_node, exclude=exclude, env=env,
    )


def agent_step_spec(config: ElasticConfig, job_id: int, node: str, gpu_count: int, *, controller_url: str,
                    state_dir: Path, token_file: Path | None) -> StepSpec:
    """The node's health agent: ``srun --overlap`` on all of the node's GPUs. Its backoff after
    failed reports stays under half of ``health.agent_silence_s``: a controller back from an outage
    hears every agent before their nodes read as of unknown health."""
    a = config.agent
    backoff_s = max(a.interval_s, config.health.agent_silence_s / 2)
    argv = [sys.executable, "-m", "slurm_elastic", "agent", "--controller-url", controller_url,
            "--source", a.source, "--interval-s", str(a.interval_s), "--max-backoff-s", f"{backoff_s:g}",
            "--node", node]
    if token_file is not None:
        argv += ["--token-file", str(token_file)]
    if a.source != "nvml":  # the drill file; where NVML works, "auto" never reads it
        argv += ["--inject-file", a.inject_file or str(state_dir / "drill.toml"), "--gpus", str(gpu_count)]
    return StepSpec(job_id=job_id, name=f"{AGENT_PREFIX}{node}", argv=tuple(argv),
                    output_path=state_dir / "logs" / f"agent-{node}.out", gpus=gpu_count,
                    nodelist=(node,), overlap=True)


def foreign_gpus_by_node(steps: list[StepInfo]) -> dict[str, int]:
    """GPUs that the job's own non-worker steps hold per node (the trainer's, say); agents overlap."""
    held: dict[str, int] = {}
    for step in steps:
        if worker_id_of_step(step.name) is not None or step.name.startswith(AGENT_PREFIX) or len(step.nodes) != 1:
            continue
        match = re.search(r"gres[:/]gpu(?::[^:,]+)?:(\d+)", step.tres_per_node)
        if match:
            held[step.nodes[0]] = held.get(step.nodes[0], 0) + int(match.group(1))
    return held


def _render(template: str, values: dict[str, str]) -> str:
    """Fill ``{name}`` placeholders we know; leave others (``{port}`` is filled on the node)."""
    out = template
    for key, value in values.items():
        out = out.replace("{" + key + "}", value)
    return out
