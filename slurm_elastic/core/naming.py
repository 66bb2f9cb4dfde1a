"""Step names: how a restarted controller recognises its own steps in Slurm's listing."""

from __future__ import annotations

import re

WORKER_PREFIX = "se-w-"
AGENT_PREFIX = "se-agent-"
_WORKER_NAME = re.compile(r"^se-w-([A-Za-z0-9_]+)$")


def worker_step_name(worker_id: str) -> str:
    return f"{WORKER_PREFIX}{worker_id}"


def worker_id_of_step(step_name: str) -> str | None:
    """The worker id encoded in a step name, or None for steps that are not our workers."""
    match = _WORKER_NAME.match(step_name)
    return match.group(1) if match else None


def format_worker_id(number: int) -> str:
    return f"{number:04d}"
