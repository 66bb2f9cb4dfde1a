"""How many client connections the API may hold: the process's open-files limit, less a reserve
for the controller's own files."""

from __future__ import annotations

import resource

from slurm_elastic.slurm.runner import PIDFDS_MAX

# descriptors kept for the controller itself: store, state files, Slurm commands, the sruns' pidfds
RESERVED_FDS = 128 + PIDFDS_MAX
MAX_CONNECTIONS = 4096


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_cap(open_files_limit: int) -> int:
    """How many client connections fit under ``open_files_limit`` with the controller's reserve."""
    return max(8, min(MAX_CONNECTIONS, open_files_limit - RESERVED_FDS))
