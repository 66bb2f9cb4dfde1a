"""The controller's side of burst jobs: render and submit them, list and cancel them through the
Slurm backend, and turn Slurm's listing into the core's :class:`~slurm_elastic.core.burst.BurstJob`.

A burst job of parent job P is named ``elastic-burst-P`` and carries the comment
``slurm-elastic burst parent=P``: a restarted controller finds (adopts) its jobs by both, and the
epilog of P cancels what is left of them.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from slurm_elastic.controller.config import ElasticConfig
from slurm_elastic.core.burst import (
    SUSPENDED_STATES,
    BurstJob,
    BurstPolicy,
    burst_job_comment,
    burst_job_name,
    burst_phase,
    on_hold,
    parent_of_comment,
)
from slurm_elastic.core.placement import burst_job_slots
from slurm_elastic.render import render_burst_script
from slurm_elastic.slurm.backend import SlurmBackend
from slurm_elastic.slurm.cli_backend import job_gpus_by_node
from slurm_elastic.slurm.parse import QueuedJob

log = logging.getLogger(__name__)

TERM_DRAINS_ENV = {"SLURM_ELASTIC_TERM_DRAINS": "1"}  # added to the environment of worker steps in burst jobs


def burst_policy(config: ElasticConfig) -> BurstPolicy:
    """The core's limits from ``[burst]``."""
    burst = config.burst
    return BurstPolicy(max_jobs=burst.max_jobs, worker_slots_per_job=worker_slots_per_job(config),
                       submit_cooldown_s=burst.submit_cooldown_s)


def worker_slots_per_job(config: ElasticConfig) -> int:
    """Workers one burst job holds: its GPUs per node over the workers' GPUs, times its nodes."""
    return burst_job_slots(config.burst.gpus_per_job, config.burst.nodes_per_job, config.workers.gpus_per_worker)


def start_time_s(text: str) -> float | None:
    """Epoch seconds of squeue's (expected) start time (ISO, the cluster's local time); None if none."""
    try:
        return datetime.fromisoformat(text).timestamp() if text else None
    except ValueError:
        return None


@dataclass(frozen=True)
class BurstJobs:
    """Submit, list and cancel the burst jobs of one parent job."""

    backend: SlurmBackend
    config: ElasticConfig
    parent_job_id: int
    state_dir: Path
    python: str = sys.executable

    @property
    def name(self) -> str:
        return burst_job_name(self.parent_job_id)

    @property
    def script(self) -> Path:
        """The batch script every burst job of this parent runs (Slurm keeps its path as the job's command)."""
        return self.state_dir / "burst" / "burst_job.sbatch"

    def submit(self, exclude_nodes: tuple[str, ...] = ()) -> int:
        """Render and submit one burst job, not on ``exclude_nodes``; returns its id. The script is
        kept in ``<state dir>/burst``."""
        script = self.script
        script.parent.mkdir(parents=True, exist_ok=True)
        text = render_burst_script(self.config, self.parent_job_id, self.state_dir, self.python, exclude_nodes)
        tmp = script.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, script)
        job_id = self.backend.submit_batch(script)
        log.info("submitted burst job %d for job %d", job_id, self.parent_job_id)
        return job_id

    def named(self) -> list[QueuedJob]:
        """The jobs Slurm lists under this parent's burst-job name, whatever their comment. One squeue call."""
        return self.backend.list_jobs_named(self.name)

    def running_the_script(self) -> list[QueuedJob]:
        """This user's jobs whose command is this parent's burst script, whatever their name and
        comment now. One squeue call over all the user's jobs: for a controller's start only."""
        wanted = {str(self.script), os.path.realpath(self.script)}
        return [j for j in self.backend.list_my_jobs() if j.command and j.command in wanted]

    def by_ids(self, job_ids: set[int]) -> list[QueuedJob]:
        """Those of ``job_ids`` Slurm still lists, whatever their name. One squeue call."""
        return self.backend.list_jobs(sorted(job_ids))

    def set_name(self, job_id: int) -> None:
        """Name the job as this parent's burst jobs are named."""
        self.backend.set_job_name(job_id, self.name)

    def listed(self) -> list[QueuedJob]:
        """This parent's burst jobs Slurm still lists (name and comment both match). One squeue call."""
        return [j for j in self.named() if self.is_ours(j)]

    def is_ours(self, job: QueuedJob) -> bool:
        """Whether a listed job's comment names this parent (a look-alike's does not)."""
        return parent_of_comment(job.comment) == self.parent_job_id

    def cancel(self, job_id: int) -> None:
        log.info("cancelling burst job %d of job %d", job_id, self.parent_job_id)
        self.backend.cancel_job(job_id)

    def mark_released(self, job_id: int, released: bool) -> None:
        """Record in the job's comment that it is being emptied (or is needed again)."""
        self.set_comment(job_id, burst_job_comment(self.parent_job_id, released))

    def set_comment(self, job_id: int, comment: str) -> None:
        self.backend.set_job_comment(job_id, comment)

    def gpus_by_node(self, job_id: int) -> dict[str, tuple[int, ...]]:
        """The GPU indexes a running burst job holds on each node (``scontrol show job -d``: this one job)."""
        return job_gpus_by_node(job_id)


def core_jobs(listed: list[QueuedJob], slots_per_job: int, workers_by_job: Mapping[int, int],
              draining_by_job: Mapping[int, int]) -> tuple[BurstJob, ...]:
    """Slurm's listing with the pool's live and draining workers per job, as the core sees it."""
    return tuple(
        BurstJob(job_id=j.job_id, phase=burst_phase(j.state), worker_slots=slots_per_job,
                 workers=workers_by_job.get(j.job_id, 0), draining_workers=draining_by_job.get(j.job_id, 0),
                 expected_start_s=start_time_s(j.start_time) if j.state == "PENDING" else None,
                 on_hold=on_hold(j.state, j.reason), completing=j.state == "COMPLETING",
                 suspended=j.state in SUSPENDED_STATES)
        for j in listed
    )
