"""Which worker ids may register: only workers this controller launched (pure).

The controller names every worker step ``se-w-<id>`` and keeps a record of each launch; a worker
whose step it adopted from Slurm's listing (after a restart without state) counts as launched too.
Any other id, even from a client holding the job's token, is refused: it would add a record to the
state file and the tick, and its step, never seen in Slurm, would count as a crash on a real GPU.
"""

from __future__ import annotations

from collections.abc import Set

from slurm_elastic.core.lifecycle import Worker
from slurm_elastic.core.naming import worker_step_name


def registration_refusal(worker_id: str, record: Worker | None, listed_ids: Set[str]) -> str:
    """Why ``worker_id`` may not register ('' if it may): it needs a record with a live step, or a
    step of that name in the latest listing of the job's steps (``listed_ids``)."""
    if (record is not None and record.has_step) or worker_id in listed_ids:
        return ""
    return (f"worker {worker_id} was not launched by this controller (no live record, and no step "
            f"{worker_step_name(worker_id)} in Slurm's listing)")
