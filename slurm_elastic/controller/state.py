"""The job's state directory and the controller's state file (what Slurm cannot hold).

Slurm is the source of truth for what runs; this file keeps what it cannot: worker records and
their history, cordons, the autoscaler's memory, manual overrides. Written atomically (write,
fsync, rename). A corrupt or foreign file is an error that names the file; the controller then
moves it aside and rebuilds from Slurm's listing, so running workers are never lost.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from slurm_elastic.errors import StateFileError

STATE_FORMAT = "slurm-elastic-controller-state"
STATE_VERSION = 1


def default_state_root() -> Path:
    """``$SLURM_ELASTIC_HOME`` or ``~/.slurm-elastic``: must be visible from every node of the job."""
    root = os.environ.get("SLURM_ELASTIC_HOME")
    return Path(root) if root else Path.home() / ".slurm-elastic"


def job_state_dir(job_id: int, configured: str = "") -> Path:
    """The job's state directory: the configured one (``{job_id}`` expanded) or ``<root>/jobs/<job id>``."""
    if configured:
        return Path(os.path.expanduser(configured.replace("{job_id}", str(job_id))))
    return default_state_root() / "jobs" / str(job_id)


def write_json_atomic(path: Path, data: dict[str, Any], mode: int = 0o600, indent: int | None = 1) -> None:
    """Write ``data`` so that readers see the old or the new file, never half of one.

    ``indent=None`` writes one line with the C encoder (several times faster for large files).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=indent, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class StateFile:
    """``state.json`` in the job's state directory."""

    def __init__(self, path: Path, job_id: int) -> None:
        self.path = path
        self.job_id = job_id

    def load(self) -> dict[str, Any]:
        """The saved state, ``{}`` if none; StateFileError if corrupt or another job's."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise StateFileError(f"cannot read state file {self.path}: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StateFileError(f"state file {self.path} is corrupt (not JSON: {exc})") from None
        if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
            raise StateFileError(f"state file {self.path} is not a slurm-elastic controller state file")
        if data.get("version") != STATE_VERSION:
            raise StateFileError(f"state file {self.path} has version {data.get('version')!r}, expected {STATE_VERSION}")
        if data.get("job_id") != self.job_id:
            raise StateFileError(f"state file {self.path} belongs to job {data.get('job_id')}, not {self.job_id}")
        body = data.get("state")
        if not isinstance(body, dict):
            raise StateFileError(f"state file {self.path} has no state object")
        return body

    def save(self, state: dict[str, Any]) -> None:
        write_json_atomic(self.path, {"format": STATE_FORMAT, "version": STATE_VERSION,
                                      "job_id": self.job_id, "saved_at": time.time(), "state": state}, indent=None)

    def move_aside(self) -> Path:
        """Rename a bad file out of the way (kept for inspection); returns its new path."""
        target = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        os.replace(self.path, target)
        return target
