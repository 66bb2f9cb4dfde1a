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
    """The SDK process (``instance``) whose heartbeats' counts a worker's record takes, in its step
    ``step`` ("job.step"; "" from an SDK that does not say), last heard at ``heard_s`` (on a clock
    that stands still while nobody could beat: a paused controller, a suspended job); ``instance``
    "": it closed, and nobody holds them."""

    instance: str
    step: str
    heard_s: float


def counts_note(worker_id: str, claim: CountsClaim | None, instance: str, step: str, current_step: str,
                now_s: float, grace_s: float) -> str:
    """Why the counts (busy, rollouts, busy_s) of a heartbeat from SDK process ``instance`` of step
    ``step`` are not ``worker_id``'s ('' if they are, and the beat's counts apply). Not the
    worker's: a process of another step than the worker's ``current_step`` (an earlier launch that
    still beats; "" while the record's step is not known yet: counts apply, as from any process),
    and a second process of one step while another holds the counts and was heard within
    ``grace_s`` (two under one id would mix their counts). Nothing is refused: the beat counts
    for liveness as any other. A process that closed lets go; one silent for ``grace_s`` is taken
    as gone."""
    if step and current_step and step != current_step:
        return (f"this process runs in step {step}, an earlier launch of worker {worker_id}; the worker now runs "
                f"as step {current_step}, so this process's rollout counts and busy time are not the worker's "
                "and are not counted (the process should end)")
    if (not instance or claim is None or claim.step != step or claim.instance in ("", instance)
            or now_s - claim.heard_s >= grace_s):
        return ""
    return (f"another process of this step already reports for worker {worker_id} (heard {now_s - claim.heard_s:.0f} "
            "s ago), so this process's rollout counts and busy time are not counted (two RolloutWorkers under one "
            "worker id would mix them); it keeps running. Run one RolloutWorker per worker id; another process's "
            "counts are taken once the first closes, or after it is silent for workers.heartbeat_grace_s "
            f"({grace_s:g} s)")
