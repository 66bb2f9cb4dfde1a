"""Whether a state directory belongs to the job now running (pure).

Job ids are not unique: they restart after a cluster is reinstalled or its state reset, wrap at
MaxJobId, and repeat between clusters that share home directories. A job is the cluster's name,
the job id and the time Slurm took the job. A requeue gives the same job a new submit time and
a higher restart count; its state directory stays its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JobIdentity:
    cluster: str
    job_id: int
    submit_time_s: int  # 0: Slurm did not say
    restart_count: int = 0
    user: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "job_id": self.job_id, "submit_time_s": self.submit_time_s,
                "restart_count": self.restart_count, "user": self.user}

    def describe(self) -> str:
        return f"job {self.job_id} of cluster {self.cluster or '?'} submitted at {self.submit_time_s or '?'}"


def identity_mismatch(recorded: JobIdentity, current: JobIdentity) -> str:
    """Why a directory recorded for ``recorded`` is not ``current``'s ('' if it is the same job)."""
    if recorded.cluster != current.cluster:
        return f"cluster {recorded.cluster!r}, not {current.cluster!r}"
    if recorded.job_id != current.job_id:
        return f"job {recorded.job_id}, not {current.job_id}"
    if current.submit_time_s == 0 or recorded.submit_time_s == current.submit_time_s:
        return ""
    requeued = (current.restart_count > recorded.restart_count and current.submit_time_s > recorded.submit_time_s
                and recorded.user == current.user)
    if requeued:
        return ""
    return f"submitted at {recorded.submit_time_s}, not {current.submit_time_s} (an earlier job with the same id)"
