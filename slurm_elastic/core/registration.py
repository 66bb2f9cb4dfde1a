"""Which worker ids may register, and what a registration makes of the worker (pure).

The controller names every worker step ``se-w-<id>`` and keeps a record of each launch; a worker
whose step it adopted from Slurm's listing (after a restart without state) counts as launched too.
Any other id, even from a client holding the job's token, is refused: it would add a record to the
state file and the tick, and its step, never seen in Slurm, would count as a crash on a real GPU.
"""

from __future__ import annotations

from collections.abc import Collection, Set
from dataclasses import dataclass

from slurm_elastic.core.lifecycle import Worker, WorkerState, transition
from slurm_elastic.core.naming import worker_step_name


def registration_refusal(worker_id: str, record: Worker | None, listed_ids: Set[str]) -> str:
    """Why ``worker_id`` may not register ('' if it may): it needs a record with a live step (one
    stopped with its suspended burst job too), or a step of that name in the latest listing of the
    job's steps (``listed_ids``)."""
    if (record is not None and record.keeps_step) or worker_id in listed_ids:
        return ""
    return (f"worker {worker_id} was not launched by this controller (no live record, and no step "
            f"{worker_step_name(worker_id)} in Slurm's listing)")


def admit(worker: Worker, cordoned: Collection[tuple[str, int]], ready: bool, now_s: float) -> None:
    """A STARTING worker that registered (and is ready, or landed on a cordoned GPU) turns ACTIVE;
    on a cordoned GPU it is a placeholder: it holds the GPU so Slurm cannot hand it out, and never
    counts as a worker (the target launches one in its place)."""
    hit = worker.cordoned_gpus(cordoned)
    if worker.state is not WorkerState.STARTING or not (hit or ready):
        return
    worker.placeholder = bool(hit)
    where = f"{worker.node} GPU {list(worker.gpus)}" + (
        f" (+ {', '.join(worker.all_nodes[1:])})" if len(worker.all_nodes) > 1 else "")
    reason = (f"landed on cordoned GPU {hit[0][0]}:{hit[0][1]}: holding it as a placeholder" if hit
              else f"ready at {worker.endpoint} on {where}" if worker.endpoint
              else f"registered on {where}")
    transition(worker, WorkerState.ACTIVE, now_s, reason)


@dataclass(frozen=True)
class CountsClaim:
    """The SDK process (``instance``) whose heartbeats carry a worker's counts for its launch number
    ``launch`` (:attr:`Worker.launches`: a relaunched worker is a new process), last heard at
    ``heard_s`` (``instance`` "": it closed, and nobody holds them); ``earlier``: the instances that held
    them for its earlier launches (the last few)."""

    instance: str
    heard_s: float
    launch: int
    earlier: tuple[str, ...] = ()


EARLIER_KEPT = 4  # instances of a worker's earlier launches remembered, to refuse a straggler of one


def claim_refusal(worker_id: str, claim: CountsClaim | None, instance: str, launch: int, now_s: float,
                  grace_s: float) -> str:
    """Why the SDK process ``instance`` may not report ``worker_id``'s counts at its launch number
    ``launch`` ('' if it may). Refused: a process of an earlier launch (a step the controller took
    as crashed or hung, still beating: its counts are not the new step's), and a second process
    while the one that holds this launch's counts was heard within ``grace_s`` (two under one id
    would mix their rollout counts and busy time). A process that closed let go; one silent for
    ``grace_s`` is taken as gone (a process restarted in its step after a crash)."""
    if claim is None:
        return ""
    if instance in claim.earlier or (claim.instance == instance and claim.launch != launch):
        return (f"duplicate worker {worker_id}: this process reported for an earlier launch of this worker id, "
                "and the controller launched it again since (it took that step as ended): its counts are not taken, "
                "the new launch's process reports for it. This process should end")
    if claim.instance in ("", instance) or claim.launch != launch or now_s - claim.heard_s >= grace_s:
        return ""
    return (f"duplicate worker {worker_id}: another process already reports for this worker id (heard "
            f"{now_s - claim.heard_s:.0f} s ago); two RolloutWorkers under one id would mix their rollout counts "
            "and busy time. Run one per worker id (each worker step the controller launches has its own); "
            f"another may take over once this one closes, or after it is silent for workers.heartbeat_grace_s "
            f"({grace_s:g} s)")


def next_claim(claim: CountsClaim | None, instance: str, launch: int, now_s: float,
               closing: bool = False) -> CountsClaim:
    """The claim after ``instance``'s beat was let in: it holds the counts (``closing``: it lets go);
    a new launch's process takes them over, and the one that held the earlier launch's is
    remembered as a process of an earlier launch."""
    if claim is None:
        return CountsClaim("" if closing else instance, now_s, launch)
    earlier = claim.earlier
    if claim.launch != launch and claim.instance not in ("", instance):
        earlier = (*earlier, claim.instance)[-EARLIER_KEPT:]
    return CountsClaim("" if closing else instance, now_s, launch, earlier)
