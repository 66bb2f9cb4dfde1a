"""The job's state directory is this job's (where it is: :func:`slurm_elastic.client.files.job_state_dir`).

The directory records the job it belongs to in ``job.json`` (cluster, job id, submit time, restart count, user). A
controller that finds a directory of another job there (an earlier job with the same id, one
left without a record) moves the whole directory aside and starts clean, with a note; one that
the job's own Slurm comment names is kept whatever its record says.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from slurm_elastic.controller.files import write_json_atomic
from slurm_elastic.core.job_identity import JobIdentity, identity_mismatch

JOB_FILE = "job.json"
JOB_FORMAT = "slurm-elastic-job"


class _JobRecord(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    format: StrictStr
    cluster: StrictStr
    job_id: StrictInt
    submit_time_s: StrictInt
    restart_count: StrictInt = 0
    user: StrictStr = ""


def read_identity(state_dir: Path) -> JobIdentity | None:
    """The job recorded in ``state_dir`` (None: no record, or not a readable one)."""
    try:
        record = _JobRecord.model_validate(json.loads((state_dir / JOB_FILE).read_text()))
    except (OSError, ValueError, ValidationError):
        return None
    if record.format != JOB_FORMAT:
        return None
    return JobIdentity(record.cluster, record.job_id, record.submit_time_s, record.restart_count, record.user)


def write_identity(state_dir: Path, job: JobIdentity) -> None:
    write_json_atomic(state_dir / JOB_FILE, {"format": JOB_FORMAT, **job.to_json()}, mode=0o644)


@dataclass(frozen=True)
class ClaimedDir:
    path: Path
    note: str = ""  # for the operator: another job's directory moved aside, or this job's lost record written again
    requeued: bool = False  # this job's directory from an earlier run of it (Slurm requeued the job)


def claim_state_dir(state_dir: Path, job: JobIdentity, named_by_job: bool = False) -> ClaimedDir:
    """Make ``state_dir`` this job's: create it, or keep it if it is this job's (a restarted
    controller, a requeue), or move another job's aside (``<dir>.stale-<time>``) and start clean.
    ``named_by_job``: the job itself names this directory (its Slurm comment, which only its own
    controllers set): a record that is missing, unreadable or names another job is damage, not
    another job's directory: it is kept as this job's, and the record written again, with a note."""
    note = ""
    if state_dir.is_dir() and any(state_dir.iterdir()):
        recorded = read_identity(state_dir)
        why = ("it has no readable job record (left by an older version, or damaged)" if recorded is None
               else identity_mismatch(recorded, job))
        if why and named_by_job:
            write_identity(state_dir, job)
            return ClaimedDir(state_dir, f"{state_dir / JOB_FILE} is not this job's record ({why}); the directory "
                                         "is this job's (its Slurm comment names it): kept, and the record written again")
        if not why:
            if recorded != job:
                write_identity(state_dir, job)  # requeued: the same job, with its new submit time
            return ClaimedDir(state_dir, requeued=recorded is not None and recorded != job)
        aside = _aside(state_dir)
        os.replace(state_dir, aside)
        whose = "another job" if recorded is None else recorded.describe()
        note = (f"state directory {state_dir} belonged to {whose}, not this {job.describe()} ({why}): "
                f"moved to {aside.name}; this job starts clean")
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_identity(state_dir, job)
    return ClaimedDir(state_dir, note)


def _aside(state_dir: Path) -> Path:
    stamp = int(time.time())
    target = state_dir.with_name(f"{state_dir.name}.stale-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = state_dir.with_name(f"{state_dir.name}.stale-{stamp}-{n}")
    return target
