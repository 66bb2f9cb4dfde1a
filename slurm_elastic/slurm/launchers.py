"""The step launches an ``srun`` on this host is still making or running: after a controller
restart, a launch its predecessor saved whose ``srun`` is not among them never ran."""

from __future__ import annotations

import psutil


def running_step_launches() -> set[tuple[int, str]] | None:
    """(job id, step name) of each ``srun`` process on this host, from its ``--jobid=`` and
    ``--job-name=`` arguments (what :func:`~slurm_elastic.slurm.backend.build_srun_argv` writes);
    None if the process table cannot be read."""
    found: set[tuple[int, str]] = set()
    try:
        for proc in psutil.process_iter(["name", "cmdline"]):
            if proc.info["name"] != "srun":
                continue
            args = proc.info["cmdline"] or []
            job = next((a.removeprefix("--jobid=") for a in args if a.startswith("--jobid=")), "")
            name = next((a.removeprefix("--job-name=") for a in args if a.startswith("--job-name=")), "")
            if job.isdigit() and name:
                found.add((int(job), name))
    except (psutil.Error, OSError):
        return None
    return found
