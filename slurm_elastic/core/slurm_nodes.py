"""Which Slurm node states take a node out of placement (pure).

Slurm writes a node's complete state as a base state and flags joined by ``+`` (``mixed+drain``,
``idle+drain+reboot_requested``, ``down+not_responding``): sinfo's ``StateComplete``, pyslurm's
``Node.state``. A node whose state holds one of :data:`OUT_OF_USE` is one an admin (or Slurm
itself) wants emptied or cannot use: new jobs do not go there, and neither do new workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from slurm_elastic.core.naming import AGENT_PREFIX

OUT_OF_USE = frozenset({
    "down",  # slurmd lost, or set down by an admin
    "drain",  # scontrol update State=DRAIN (shown as draining/drained)
    "fail",  # State=FAIL: drain, and the node is expected to fail
    "maintenance",  # a maintenance reservation (Flags=MAINT) holds the node now, as StateComplete says it
    "maint",  # ... and as sinfo's short state (%t) says it
    "reboot_requested",  # scontrol reboot: the node reboots once it is idle
    "reboot_issued",
    "power_down",  # being powered down (power saving)
    "powering_down",
})


def out_of_use_reason(node: str, state: str, reason: str) -> str | None:
    """Why ``node`` in Slurm ``state`` (with the admin's ``reason``) gets no new worker; None when it may."""
    flags = set(state.lower().split("+")) & OUT_OF_USE
    if not flags:
        return None
    said = f": {reason.strip()}" if reason.strip() and reason.strip().lower() != "none" else ""
    return f"Slurm marks node {node} {state.upper()}{said}"


def out_of_use_nodes(states: Mapping[str, tuple[str, str]]) -> dict[str, str]:
    """Node -> why it is out of use, from node -> (complete state, reason)."""
    out = {}
    for node, (state, reason) in states.items():
        why = out_of_use_reason(node, state, reason)
        if why is not None:
            out[node] = why
    return out


def nodes_to_release(out_of_use: Mapping[str, str], job_nodes: Sequence[str], batch_host: str,
                     steps_by_node: Mapping[str, Sequence[str]]) -> list[str]:
    """The job's nodes to give back to Slurm now: out of use, not the batch host (the batch script
    and the controller run there), and running no step but node agents (``steps_by_node``: the
    names of the job's steps on each node, placeholders left out by the caller; a worker still
    draining, the trainer, anything else keeps the node). One node always stays."""
    keep_one = [n for n in job_nodes if n not in out_of_use or n == batch_host]
    if not keep_one:
        return []
    return [node for node in job_nodes
            if node in out_of_use and node != batch_host
            and all(name.startswith(AGENT_PREFIX) for name in steps_by_node.get(node, ()))]
