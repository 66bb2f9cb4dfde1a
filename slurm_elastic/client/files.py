"""Where a job's controller publishes itself, read from the client side (stdlib only).

The job's state directory is ``<root>/jobs/<cluster>/<job id>`` by default (``$SLURM_ELASTIC_HOME``
or ``~/.slurm-elastic``), or ``controller.state_dir`` with ``{cluster}`` and ``{job_id}`` filled in.
In it: ``token`` (the job's bearer token, 0600, with a copy ``.token.copy`` read when the token
file is lost or emptied) and ``controller.json`` (url, pid, host).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

TOKEN_FILE = "token"
TOKEN_COPY = ".token.copy"
CONTROLLER_FILE = "controller.json"
STATE_DIR_POINTER = "state_dir"  # in the default place: the configured state directory (controller.state_dir)
STOPPED_KEY = "stopped_by_operator_at"  # in controller.json, once its controller obeyed `slurm-elastic stop`


def default_state_root() -> Path:
    """``$SLURM_ELASTIC_HOME`` or ``~/.slurm-elastic``: must be visible from every node of the job."""
    root = os.environ.get("SLURM_ELASTIC_HOME")
    return Path(root) if root else Path.home() / ".slurm-elastic"


def path_part(name: str) -> str:
    """``name`` as one safe path component (a cluster name from Slurm is one already)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "unknown-cluster"


def job_state_dir(cluster: str, job_id: int, configured: str = "") -> Path:
    """The configured directory (``{cluster}``, ``{job_id}`` filled in) or ``<root>/jobs/<cluster>/<job id>``."""
    if configured:
        return Path(os.path.expanduser(configured.replace("{job_id}", str(job_id))
                                       .replace("{cluster}", path_part(cluster))))
    return default_state_root() / "jobs" / path_part(cluster) / str(job_id)


def job_dirs_of_every_cluster(job_id: int) -> list[Path]:
    """``<root>/jobs/<cluster>/<job id>`` of each cluster that has one (sorted): where a job's
    state directory may be when the cluster's name is not known here."""
    try:
        clusters = sorted((default_state_root() / "jobs").iterdir())
    except OSError:
        return []
    return [cluster / str(job_id) for cluster in clusters if (cluster / str(job_id)).is_dir()]


def read_token_file(path: Path) -> str:
    """The job's token from ``path``, else from the copy beside it (``.token.copy``); '' if
    neither holds one (missing, empty, unreadable, not text)."""
    return read_token_and_file(path)[0]


def read_token_and_file(path: Path) -> tuple[str, Path]:
    """The token as :func:`read_token_file` reads it, with the file it came from (``path``
    when neither holds one)."""
    for candidate in (path, path.with_name(TOKEN_COPY)):
        try:
            token = candidate.read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if token:
            return token, candidate
    return "", path


def token_file_source(described: str, path: Path, read: Path) -> str:
    """Where a token read for ``path`` (``described``: what names it) came from, for a refusal's
    message: ``described``, or the copy beside it when ``path`` held none."""
    return described if read == path else f"{read} (the copy beside {described}, which held no token)"


def read_controller_url(state_dir: Path) -> str:
    """The URL in ``controller.json`` ('' if none)."""
    try:
        return str(json.loads((state_dir / CONTROLLER_FILE).read_text()).get("url", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def stopped_by_operator_at(state_dir: Path) -> float | None:
    """When the controller named in ``controller.json`` ended on an operator's ``slurm-elastic
    stop`` (seconds since the epoch); None if it did not (or no file says so)."""
    try:
        value = json.loads((state_dir / CONTROLLER_FILE).read_text()).get(STOPPED_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) else None


def pointed_state_dir(default_dir: Path) -> Path | None:
    """The configured state directory named in ``default_dir`` by its controller, if any."""
    try:
        text = (default_dir / STATE_DIR_POINTER).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return Path(text) if text.startswith("/") else None
