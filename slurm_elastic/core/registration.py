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


def step_refusal(worker_id: str, step: str, current_step: str) -> str:
    """Why an SDK process of step ``step`` ("job.step") may not report ``worker_id``'s counts ('' if
    it may): the worker now runs as ``current_step`` (its record's job and step; "" while not known),
    and a process of another step is one of its earlier launches (a step the controller took as
    ended, still beating): its counts are not the worker's now. Stateless: right after a controller
    restart too, and a step adopted again is the same step."""
    if not step or not current_step or step == current_step:
        return ""
    return (f"duplicate worker {worker_id}: this process belongs to step {step}, an earlier launch of worker "
            f"{worker_id}; the worker now runs as step {current_step}. Its counts are not taken, and this process "
            "should end")


@dataclass(frozen=True)
class CountsClaim:
    """The SDK process (``instance``) whose heartbeats carry a worker's counts in its step ``step``
    ("job.step"; "" from an SDK that does not say), last heard at ``heard_s`` (on a clock that stands
    still while nobody could beat: a paused controller, a suspended job), after ``beats`` beats let in (``instance`` "": it closed, and nobody holds them)."""

    instance: str
    step: str
    heard_s: float
    beats: int = 1


def claim_refusal(worker_id: str, claim: CountsClaim | None, instance: str, step: str, now_s: float,
                  grace_s: float) -> str:
    """Why the SDK process ``instance`` of step ``step`` may not report ``worker_id``'s counts ('' if
    it may): another process of the same step holds them and was heard within ``grace_s`` (two under
    one id would mix their rollout counts and busy time). A process that closed let go; one silent
    for ``grace_s`` is taken as gone (a process restarted in its step after a crash); a claim made
    in another step is not this step's (a relaunch is a new process)."""
    if claim is None or claim.step != step or claim.instance in ("", instance) or now_s - claim.heard_s >= grace_s:
        return ""
    return (f"duplicate worker {worker_id}: another process already reports for this worker id (heard "
            f"{now_s - claim.heard_s:.0f} s ago, {claim.beats} beats); two RolloutWorkers under one id would mix "
            "their rollout counts and busy time. Run one per worker id (each worker step the controller launches "
            "has its own); another may take over once this one closes, or after it is silent for "
            f"workers.heartbeat_grace_s ({grace_s:g} s)")


def next_claim(claim: CountsClaim | None, instance: str, step: str, now_s: float,
               closing: bool = False) -> CountsClaim:
    """The claim after ``instance``'s beat was let in: it holds the counts, its beats counted on
    (``closing``: it lets go)."""
    beats = claim.beats + 1 if claim is not None and (claim.instance, claim.step) == (instance, step) else 1
    return CountsClaim("" if closing else instance, step, now_s, beats)
