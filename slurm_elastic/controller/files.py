"""The files a controller publishes in the job's state directory (the readers: :mod:`slurm_elastic.client.files`).

``token`` (0600, reused across controller restarts so running workers keep working, with a copy,
``.token.copy``, it is restored from if the token file is lost) and ``controller.json`` (url, pid,
host), written atomically.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

from slurm_elastic.client.files import CONTROLLER_FILE, STOPPED_KEY, TOKEN_COPY, TOKEN_FILE


def write_json_atomic(path: Path, data: dict[str, Any], mode: int = 0o600, indent: int | None = 1,
                      previous: Path | None = None) -> None:
    """Write ``data`` so that readers see the old or the new file, never half of one.

    ``indent=None`` writes one line, with the C encoder (the one to use for large files);
    ``previous``: where the file it replaces is kept (:func:`write_text_atomic`).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=indent, sort_keys=True), mode, previous)


def write_text_atomic(path: Path, text: str, mode: int = 0o600, previous: Path | None = None) -> None:
    """Write ``text`` to ``path`` (made with ``mode``) so that readers see the old file or the new
    one, never an empty or half-written one. With ``previous``, the file it replaces is renamed
    there first: between the two renames only ``previous`` holds the state."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if previous is not None and path.is_file():
            os.replace(path, previous)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def ensure_token(state_dir: Path) -> tuple[tuple[str, ...], Path, str]:
    """The job's secret tokens (mode 0600, only the job's user can read them: one, or two where
    the file and its copy differ), the token file, and a note for the operator ('' if none).

    The token of the file, else of its copy (the file is restored: running workers and the
    trainer hold that token), else a new one, made once. Where the file and its copy differ, one
    was changed or damaged and nothing tells which the clients hold: both are accepted and both
    files kept, unless only one has the shape of a token made here (the other is written again
    from it). The note says when a token was restored, when two are accepted, or when one was
    made anew where a controller ran before (whoever holds the old one is refused until it restarts)."""
    path, copy = state_dir / TOKEN_FILE, state_dir / TOKEN_COPY
    token, kept, note = _read_secret(path), _read_secret(copy), ""
    if token and kept and token != kept and _made_here(token) == _made_here(kept):
        os.chmod(path, 0o600)
        return (token, kept), path, (f"the job's token file {path} and its copy {copy.name} differ (one was changed "
                                     "or damaged): both tokens are accepted; write the right one into both files")
    if token and kept and token != kept and _made_here(kept):
        token, note = "", f"the job's token file {path} is not a token this job made: restored from {copy.name}"
    if not token:
        token = kept
        if token:
            note = note or f"the job's token file {path} was missing or empty: restored from {copy.name}"
        else:
            token = secrets.token_urlsafe(32)
            if (state_dir / CONTROLLER_FILE).exists():
                note = (f"the job's token file {path} and its copy were missing or empty: a new token was made; "
                        "workers and a trainer started before hold the old one and are refused (403) until they "
                        "restart")
        write_text_atomic(path, token + "\n")
    else:
        os.chmod(path, 0o600)
    if _read_secret(copy) != token:
        write_text_atomic(copy, token + "\n")
    return (token,), path, note


def _made_here(token: str) -> bool:
    """``token`` has the shape of one :func:`ensure_token` makes (``secrets.token_urlsafe(32)``)."""
    return len(token) == 43 and all(c.isascii() and (c.isalnum() or c in "-_") for c in token)


def _read_secret(path: Path) -> str:
    """The stripped text of ``path`` ('' if it is missing, unreadable or not text)."""
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def previous_port(state_dir: Path, host: str) -> int:
    """The port of this job's last controller if it is free again (so running workers' URL
    stays valid across a restart), else 0 (any free port; workers re-read controller.json)."""
    try:
        info = json.loads((state_dir / CONTROLLER_FILE).read_text())
        port = int(str(info.get("url", "")).rsplit(":", 1)[1])
    except (OSError, ValueError, IndexError):
        return 0
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return 0
    return port


def publish(state_dir: Path, url: str, job_id: int, extra: dict[str, Any] | None = None) -> None:
    """Write ``controller.json`` for the CLI and the workers."""
    write_json_atomic(state_dir / CONTROLLER_FILE, {
        "url": url, "pid": os.getpid(), "host": socket.gethostname(), "job_id": job_id,
        "started_at": time.time(), **(extra or {}),
    }, mode=0o644)


def mark_stopped_by_operator(state_dir: Path) -> None:
    """Say in ``controller.json`` that its controller ended on ``slurm-elastic stop`` (a second
    stop then knows; a new controller's :func:`publish` clears it)."""
    path = state_dir / CONTROLLER_FILE
    try:
        info = json.loads(path.read_text())
        write_json_atomic(path, {**info, STOPPED_KEY: time.time()}, mode=0o644)
    except (OSError, ValueError, TypeError):
        pass  # the stop happened all the same; a second stop then says the controller does not answer
