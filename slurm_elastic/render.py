"""Render batch scripts from the jinja2 templates in ``templates/``."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import jinja2

from slurm_elastic.controller.burst_config import split_excludes
from slurm_elastic.controller.config import (
    ElasticConfig,
    check_worker_command,
    most_burst_workers,
    worker_floor,
)
from slurm_elastic.core.burst import BURST_NAME_PREFIX, burst_job_comment, burst_job_name
from slurm_elastic.core.placement import most_workers
from slurm_elastic.core.shape import worker_shape
from slurm_elastic.errors import ConfigError
from slurm_elastic.resources import templates_dir


def _templates() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )


def render_sbatch(config: ElasticConfig, config_path: str) -> str:
    """The batch script for ``config`` (``config_path`` as the script should name it)."""
    if not config.job.trainer_command:
        raise ConfigError(f"{config_path}: job.trainer_command is empty: name the trainer to run")
    check_worker_command(config, config_path)
    if config.job.trainer_gpus > config.job.gpus_per_node:
        raise ConfigError(f"{config_path}: job.trainer_gpus ({config.job.trainer_gpus}) > job.gpus_per_node "
                          f"({config.job.gpus_per_node}): the trainer step could never start")
    _check_worker_room(config, config_path)
    _check_worker_floor(config, config_path)
    _check_node_memory(config, config_path)
    return _templates().get_template("elastic_rl.sbatch.j2").render(
        job=config.job,
        config_path=shlex.quote(config_path),
        trainer_command=shlex.join(config.job.trainer_command),
        drain_timeout_s=f"{config.workers.drain_timeout_s:g}",
        burst_name_prefix=BURST_NAME_PREFIX if config.burst.max_jobs else "",
    )


def _check_worker_room(config: ElasticConfig, config_path: str) -> None:
    """ConfigError when no worker could ever start beside the trainer (and no burst job can hold one):
    a worker over k nodes needs k nodes with its GPUs free, the trainer's node included."""
    job, workers = config.job, config.workers
    if config.burst.max_jobs or not workers.gpus_per_worker:
        return
    shape = worker_shape(workers.gpus_per_worker, workers.nodes_per_worker, job.gpus_per_node,
                         nodes_in_job=job.nodes)
    left_gpus = job.gpus_per_node - job.trainer_gpus  # GPUs the trainer leaves on its node
    if job.nodes - 1 + (left_gpus >= shape.gpus_per_node) >= shape.nodes:
        return
    most = job.gpus_per_node - shape.gpus_per_node
    fewer = f"job.trainer_gpus to at most {most}" if most else "job.trainer_gpus = 0 (a trainer without GPUs)"
    raise ConfigError(
        f"{config_path}: no worker could ever start: one of workers.gpus_per_worker = {workers.gpus_per_worker} "
        f"takes {shape.gpus_per_node} GPUs on each of {shape.nodes} node(s), and the trainer's "
        f"job.trainer_gpus = {job.trainer_gpus} leaves {left_gpus} of its node's {job.gpus_per_node} "
        f"(job.nodes = {job.nodes}); set {fewer} or job.nodes = {shape.nodes + 1}")


def _check_worker_floor(config: ElasticConfig, config_path: str) -> None:
    """ConfigError when the fewest workers the job keeps (:func:`worker_floor`) are more than its
    nodes, less the trainer's GPUs, and all of its burst jobs can ever hold: the controller would
    wait for the others for ever. The GPUs per node are the controller's (``controller.gpus_per_node``
    when set, as the config's load and the controller take them), else ``job.gpus_per_node``."""
    job, workers = config.job, config.workers
    if not workers.gpus_per_worker:
        return
    key, floor = worker_floor(config)
    node_gpus = config.controller.gpus_per_node or job.gpus_per_node
    where = "controller.gpus_per_node" if config.controller.gpus_per_node else "job.gpus_per_node"
    shape = worker_shape(workers.gpus_per_worker, workers.nodes_per_worker, node_gpus, nodes_in_job=job.nodes)
    slots = most_workers([node_gpus - job.trainer_gpus] + [node_gpus] * (job.nodes - 1), shape.gpus, shape.nodes)
    burst = most_burst_workers(config)
    if floor <= slots + burst:
        return
    lent = f", and the burst.max_jobs = {config.burst.max_jobs} burst job(s) at most {burst} more" if burst else ""
    raise ConfigError(
        f"{config_path}: {key} = {floor} workers can never all be placed: the job's job.nodes = {job.nodes} "
        f"node(s) of {where} = {node_gpus} GPUs, job.trainer_gpus = {job.trainer_gpus} of them "
        f"the trainer's, hold at most {slots} of workers.gpus_per_worker = {workers.gpus_per_worker}{lent}; the "
        f"controller would wait for the other {floor - slots - burst} for ever. Set {key} to at most "
        f"{slots + burst}, or give the job more nodes (job.nodes)")


def _check_node_memory(config: ElasticConfig, config_path: str) -> None:
    """ConfigError unless the trainer and the workers that fit beside it by GPUs fit in
    ``job.mem_per_node_mb`` (a worker step that asks for more memory than is left never starts)."""
    job, workers = config.job, config.workers
    if not job.mem_per_node_mb:
        return
    shape = worker_shape(workers.gpus_per_worker, workers.nodes_per_worker, job.gpus_per_node,
                         nodes_in_job=job.nodes)
    per_node = shape.gpus_per_node or job.gpus_per_node or 1
    beside_trainer = (job.gpus_per_node - job.trainer_gpus) // per_node if shape.gpus_per_node else 0
    needed_mb = job.trainer_mem_mb + beside_trainer * workers.mem_per_worker_mb
    if needed_mb > job.mem_per_node_mb:
        raise ConfigError(
            f"{config_path}: job.trainer_mem_mb ({job.trainer_mem_mb}) + {beside_trainer} workers of "
            f"workers.mem_per_worker_mb ({workers.mem_per_worker_mb}) = {needed_mb} MB > job.mem_per_node_mb "
            f"({job.mem_per_node_mb}): the workers on the trainer's node that find no memory never start")
    on_other_nodes_mb = job.gpus_per_node // per_node * workers.mem_per_worker_mb if job.nodes > 1 else 0
    if on_other_nodes_mb > job.mem_per_node_mb:
        raise ConfigError(
            f"{config_path}: {job.gpus_per_node // per_node} workers of workers.mem_per_worker_mb "
            f"({workers.mem_per_worker_mb}) = {on_other_nodes_mb} MB > job.mem_per_node_mb ({job.mem_per_node_mb}): "
            "the workers of a node that find no memory never start")


def render_burst_script(config: ElasticConfig, parent_job_id: int, state_dir: Path, python: str = sys.executable,
                        exclude_nodes: tuple[str, ...] = ()) -> str:
    """The batch script of one burst job of ``parent_job_id``: it holds ``[burst]``'s GPUs with the
    CPUs and memory of the workers that fit, and watches the controller through ``state_dir``;
    not on ``exclude_nodes`` (every GPU there is cordoned)."""
    burst, workers = config.burst, config.workers
    user_excludes, extra_options = split_excludes(burst.extra_sbatch_options)
    gpus_per_node = burst.gpus_per_job // burst.nodes_per_job
    workers_per_node = gpus_per_node // workers.gpus_per_worker if workers.gpus_per_worker else 1
    return _templates().get_template("burst_job.sbatch.j2").render(
        burst=burst,
        gpus_per_node=gpus_per_node,
        parent_job_id=int(parent_job_id),
        name=burst_job_name(parent_job_id),
        comment=burst_job_comment(parent_job_id),
        cpus_per_node=max(1, workers_per_node * workers.cpus_per_worker),
        mem_per_node_mb=workers_per_node * workers.mem_per_worker_mb,
        drain_signal=workers.drain_signal,
        output=shlex.quote(str(state_dir / "burst" / "burst-%j.out")),
        python=shlex.quote(python),
        state_dir=shlex.quote(str(state_dir)),
        grace_s=f"{burst.controller_unreachable_grace_s:g}",
        exclude_nodes=",".join(dict.fromkeys([*user_excludes, *exclude_nodes])),
        extra_options=extra_options,
    )
