"""Find a job's controller from the job id alone: its state directory, URL and token."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_elastic.controller.files import CONTROLLER_FILE, TOKEN_FILE
from slurm_elastic.controller.state import job_state_dir
from slurm_elastic.errors import ControllerUnreachableError, SlurmError
from slurm_elastic.slurm.cli_backend import SlurmCli

COMMENT_PREFIX = "slurm-elastic:"


@dataclass(frozen=True)
class JobHandle:
    job_id: int
    state_dir: Path
    url: str
    token: str
    info: dict[str, Any]


def state_dir_from_comment(comment: str) -> Path | None:
    if comment.startswith(COMMENT_PREFIX):
        return Path(comment.removeprefix(COMMENT_PREFIX).strip())
    return None


def locate(job_id: int, slurm: SlurmCli | None = None) -> JobHandle:
    """The job's controller as published in its state directory (default place, else the job comment)."""
    candidates = [job_state_dir(job_id)]
    if not (candidates[0] / CONTROLLER_FILE).exists():
        try:
            comment_dir = state_dir_from_comment((slurm or SlurmCli()).job_info(job_id).comment)
        except SlurmError:
            comment_dir = None
        if comment_dir is not None:
            candidates.append(comment_dir)
    for state_dir in candidates:
        path = state_dir / CONTROLLER_FILE
        try:
            info = json.loads(path.read_text())
            token = (state_dir / TOKEN_FILE).read_text().strip()
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            raise ControllerUnreachableError(f"cannot read {path} or its token: {exc}") from None
        if not isinstance(info, dict) or "url" not in info:
            raise ControllerUnreachableError(f"{path} is not a controller file")
        return JobHandle(job_id, state_dir, str(info["url"]), token, info)
    raise ControllerUnreachableError(
        f"no controller found for job {job_id} (looked in {', '.join(str(c) for c in candidates)})"
    )
