"""Where workers may go: worker slots on the usable GPUs of each allocation (pure).

Capacity is data: a tuple of :class:`Allocation` (today the controller's own job; other Slurm
jobs' allocations plug in here). A GPU is usable unless it is cordoned, its node's agent is not
heard, or the job's other steps (the trainer's, say) hold it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
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
                     unknown_nodes: Collection[str] = (), foreign_gpus: Mapping[str, int] | None = None) -> Slots:
    """Worker slots on the allocation's usable GPUs; a node with too few usable GPUs is excluded."""
    if gpus_per_worker == 0:
        return Slots(allocation.job_id, CPU_ONLY_SLOTS, ())
    foreign = foreign_gpus or {}
    slots, exclude = 0, []
    for node, gpus in allocation.gpus_by_node.items():
        usable = [] if node in unknown_nodes else [g for g in gpus if (node, g) not in cordoned]
        usable = usable[: max(0, len(usable) - foreign.get(node, 0))]
        if len(usable) < gpus_per_worker:
            exclude.append(node)  # every GPU there is cordoned (or too few are left)
        slots += len(usable) // gpus_per_worker
    return Slots(allocation.job_id, slots, tuple(exclude))


def placement(allocations: tuple[Allocation, ...], gpus_per_worker: int, cordoned: Collection[GpuKey],
              unknown_nodes: Collection[str] = (), foreign_gpus: Mapping[int, Mapping[str, int]] | None = None
              ) -> tuple[Slots, ...]:
    """Each allocation's slots, in the order given (launches fill them in that order).
    ``foreign_gpus``: per job id, the GPUs its non-worker steps hold on each node."""
    foreign = foreign_gpus or {}
    return tuple(allocation_slots(a, gpus_per_worker, cordoned, unknown_nodes, foreign.get(a.job_id))
                 for a in allocations)
