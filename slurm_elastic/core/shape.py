"""A worker step's shape: how many nodes it spans and how many GPUs it takes on each (pure).

``workers.gpus_per_worker`` above a node's GPUs (a tensor/pipeline-parallel engine) makes one
step over several whole nodes: ``srun --nodes=k`` with ``gpus_per_worker / k`` GPUs on each.
``workers.nodes_per_worker`` (0: derived) spreads a worker over k nodes explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_elastic.errors import ConfigError


@dataclass(frozen=True)
class WorkerShape:
    """One worker step: ``nodes`` nodes with ``gpus_per_node`` GPUs and ``tasks_per_node`` tasks on each."""

    nodes: int = 1
    gpus_per_node: int = 1
    tasks_per_node: int = 1

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def worker_shape(gpus_per_worker: int, nodes_per_worker: int, node_gpus: int, *, tasks_per_node: int = 1,
                 nodes_in_job: int = 0, where: str = "the job's nodes") -> WorkerShape:
    """The shape of a worker of ``gpus_per_worker`` GPUs on nodes of ``node_gpus`` GPUs each.

    ``nodes_per_worker`` 0 derives k: 1 when the worker fits on one node, else
    ``gpus_per_worker / node_gpus`` whole nodes. Raises ConfigError naming the valid values."""
    if gpus_per_worker == 0:
        return WorkerShape(max(1, nodes_per_worker), 0, tasks_per_node)
    k = nodes_per_worker
    if k == 0:
        if node_gpus <= 0 or gpus_per_worker <= node_gpus:
            k = 1
        elif gpus_per_worker % node_gpus:
            raise ConfigError(
                f"workers.gpus_per_worker = {gpus_per_worker} does not fill whole nodes of {node_gpus} GPUs "
                f"({where}): a worker bigger than one node takes whole nodes, so valid values are 1 to "
                f"{node_gpus} or a multiple of {node_gpus} ({_multiples(node_gpus, nodes_in_job)}); "
                "or set workers.nodes_per_worker to spread it over that many nodes")
        else:
            k = gpus_per_worker // node_gpus
    if gpus_per_worker % k:
        raise ConfigError(
            f"workers.gpus_per_worker = {gpus_per_worker} does not divide evenly over "
            f"workers.nodes_per_worker = {k} nodes: every node of a worker gets the same GPUs, so "
            f"gpus_per_worker must be a multiple of {k}")
    per_node = gpus_per_worker // k
    if node_gpus > 0 and per_node > node_gpus:
        raise ConfigError(
            f"workers.gpus_per_worker = {gpus_per_worker} over {k} node(s) needs {per_node} GPUs per node, "
            f"but {where} have {node_gpus} GPUs")
    if nodes_in_job and k > nodes_in_job:
        raise ConfigError(
            f"workers.gpus_per_worker = {gpus_per_worker} needs {k} nodes of {per_node} GPUs, "
            f"but the job has {nodes_in_job} node(s)")
    return WorkerShape(k, per_node, tasks_per_node)


def shape_for_allocation(gpus_per_worker: int, nodes_per_worker: int, tasks_per_node: int,
                         gpus_by_node: dict[str, tuple[int, ...]]) -> WorkerShape:
    """The shape against a real allocation (its nodes' GPUs): the largest node decides k; a
    node with fewer GPUs than a worker needs per node gets no worker."""
    most = max((len(g) for g in gpus_by_node.values()), default=0)
    return worker_shape(gpus_per_worker, nodes_per_worker, most, tasks_per_node=tasks_per_node,
                        nodes_in_job=len(gpus_by_node), where=_nodes_named(gpus_by_node, most))


def _nodes_named(gpus_by_node: dict[str, tuple[int, ...]], most: int) -> str:
    names = [n for n, g in gpus_by_node.items() if len(g) == most]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"the job's nodes ({shown})" if names else "the job's nodes"


def _multiples(node_gpus: int, nodes_in_job: int) -> str:
    top = max(2, nodes_in_job) if nodes_in_job else 4
    shown = [str(node_gpus * i) for i in range(2, top + 1)]
    return ", ".join(shown) + ("" if nodes_in_job else ", ...")

