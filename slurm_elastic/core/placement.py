"""Where workers may go: worker slots on the usable GPUs of each allocation (pure).

Capacity is data: a tuple of :class:`Allocation` (today the controller's own job; other Slurm
jobs' allocations plug in here). A GPU is usable unless it is cordoned, its node's agent is not
heard, or the job's other steps (the trainer's, say) hold it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

GpuKey = tuple[str, int]
CPU_ONLY_SLOTS = 1_000_000  # CPU-only workers: GPU slots do not bound them


@dataclass(frozen=True, eq=False)
class Allocation:
    """One Slurm job's GPUs that workers may use: the GPU indexes on each of its nodes."""

    job_id: int
    gpus_by_node: Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class Slots:
    """One allocation's worker slots this tick, and the nodes to ``--exclude`` there."""

    job_id: int
    slots: int
    exclude_nodes: tuple[str, ...]


def allocation_slots(allocation: Allocation, gpus_per_worker: int, cordoned: Collection[GpuKey],
                     unknown_nodes: Collection[str] = (), foreign_gpus: Mapping[str, int] | None = None,
                     nodes_per_worker: int = 1, own_gpus: Collection[GpuKey] = ()) -> Slots:
    """Worker slots on the allocation's usable GPUs; a node with too few usable GPUs is excluded.
    A worker over ``nodes_per_worker`` nodes takes ``gpus_per_worker / nodes_per_worker`` on each.

    Slurm names how many GPUs a node's other steps (the trainer's) hold, not which: they are taken
    first from the cordoned GPUs none of ``own_gpus`` (those the pool's steps hold) is on, so a
    cordoned trainer GPU is not taken off twice. Where the guess is wrong, a launch lands on the
    cordoned GPU, holds it as a placeholder, and the next count is exact."""
    if gpus_per_worker == 0:
        return Slots(allocation.job_id, CPU_ONLY_SLOTS, ())
    foreign = foreign_gpus or {}
    per_node = gpus_per_worker // nodes_per_worker
    node_slots, exclude = [], []
    for node, gpus in allocation.gpus_by_node.items():
        usable = [] if node in unknown_nodes else [g for g in gpus if (node, g) not in cordoned]
        cordoned_unheld = sum(1 for g in gpus if (node, g) in cordoned and (node, g) not in own_gpus)
        usable = usable[: max(0, len(usable) - max(0, foreign.get(node, 0) - cordoned_unheld))]
        if len(usable) < per_node:
            exclude.append(node)  # every GPU there is cordoned (or too few are left)
        node_slots.append(len(usable) // per_node)
    return Slots(allocation.job_id, multi_node_slots(node_slots, nodes_per_worker), tuple(exclude))


def multi_node_slots(node_slots: list[int], nodes_per_worker: int) -> int:
    """How many workers of ``nodes_per_worker`` distinct nodes fit when node i holds ``node_slots[i]``
    per-node shares: the largest W with sum(min(slots_i, W)) >= nodes_per_worker * W."""
    if nodes_per_worker <= 1:
        return sum(node_slots)
    workers = sum(node_slots) // nodes_per_worker
    while workers > 0 and sum(min(s, workers) for s in node_slots) < nodes_per_worker * workers:
        workers -= 1
    return workers


def most_workers(node_gpus: Sequence[int], gpus_per_worker: int, nodes_per_worker: int = 1) -> int:
    """Workers that fit at most on nodes of ``node_gpus`` GPUs each, none cordoned or held by
    another step (0 GPUs per worker: :data:`CPU_ONLY_SLOTS`)."""
    if gpus_per_worker == 0:
        return CPU_ONLY_SLOTS
    per_node = gpus_per_worker // max(1, nodes_per_worker)
    return multi_node_slots([max(0, gpus) // per_node for gpus in node_gpus], nodes_per_worker)


def burst_job_slots(gpus_per_job: int, nodes_per_job: int, gpus_per_worker: int) -> int:
    """Workers one burst job holds: its GPUs per node over the workers' GPUs, times its nodes."""
    return max(1, gpus_per_job // nodes_per_job // (gpus_per_worker or 1)) * nodes_per_job


def placement(allocations: tuple[Allocation, ...], gpus_per_worker: int, cordoned: Collection[GpuKey],
              unknown_nodes: Collection[str] = (), foreign_gpus: Mapping[int, Mapping[str, int]] | None = None,
              nodes_per_worker: int = 1, own_gpus: Collection[GpuKey] = ()) -> tuple[Slots, ...]:
    """Each allocation's slots, in the order given (launches fill them in that order).
    ``foreign_gpus``: per job id, the GPUs its non-worker steps hold on each node; ``own_gpus``:
    the GPUs the pool's steps hold (workers and placeholders)."""
    foreign = foreign_gpus or {}
    return tuple(allocation_slots(a, gpus_per_worker, cordoned, unknown_nodes, foreign.get(a.job_id),
                                  nodes_per_worker, own_gpus) for a in allocations)


def cordon_note(node: str, gpu: int, node_gpus: Collection[int], holders: Mapping[GpuKey, str],
                foreign_on_node: int) -> str:
    """What an operator's cordon of ``node:gpu`` leaves as it is, where that is not plain: a cordon
    only keeps new workers off. ``holders``: the pool's steps' GPUs and the worker holding each;
    (a placeholder's: ""); ``foreign_on_node``: how many GPUs the job's other steps (the trainer's) hold there. Slurm
    names how many, not which: a GPU no worker holds is theirs for sure only when every such GPU
    of the node is."""
    holder = holders.get((node, gpu))
    if holder is not None:  # "": a placeholder of the pool's holds it (a GPU cordoned before)
        return "" if not holder else (f"worker {holder} runs on {node}:{gpu} and keeps running: a cordon only keeps new workers off "
                f"(`drain` moves it off)")
    if foreign_on_node <= 0:
        return ""
    free = [g for g in node_gpus if (node, g) not in holders]
    whose = ("it is one of them" if len(free) <= foreign_on_node
             else "no worker holds it, so it may be one of them")
    return (f"the job's other steps (the trainer's) hold {foreign_on_node} GPU(s) of {node} and {whose}: a cordon "
            "only keeps workers off, so the trainer keeps running on it, and no worker goes there after the "
            "trainer ends until it is uncordoned")
