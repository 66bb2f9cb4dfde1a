"""``slurm-elastic-epilog``: after a job, kill its leftover slurm-elastic processes and clean up.

A process is this job's leftover when its environment says ``SLURM_JOB_ID=<this job>`` and marks
it as slurm-elastic's (a worker, a worker command, a controller client), it belongs to the
job's user, and it is not a Slurm daemon. Another job's processes are never touched. It then
removes the job's node-local state directory. It always exits 0.
"""

from __future__ import annotations

import os
import shutil
import sys

import psutil

from slurm_elastic.hooks.common import HookConfig, job_dir, load_hook_config, setup_logging

MARKERS = ("SLURM_ELASTIC_WORKER_ID", "SLURM_ELASTIC_CONTROLLER_URL", "SLURM_ELASTIC_STATE_DIR")
NEVER = {"slurmd", "slurmstepd", "slurmctld", "systemd", "init"}


def leftovers(job_id: str, uid: int | None) -> list[psutil.Process]:
    """This job's slurm-elastic processes still running on this node."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "name", "uids"]):
        try:
            if proc.pid in (1, me) or proc.info["name"] in NEVER:
                continue
            if uid is not None and proc.info["uids"] and proc.info["uids"].real != uid:
                continue
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("SLURM_JOB_ID") == job_id and any(m in env for m in MARKERS):
            found.append(proc)
    return found


def run(config: HookConfig) -> int:
    log = setup_logging(config, "epilog")
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not job_id:
        log.error("no SLURM_JOB_ID: not run by slurmd; nothing to do")
        return 0
    uid_text = os.environ.get("SLURM_JOB_UID", "")
    procs = leftovers(job_id, int(uid_text) if uid_text.isdigit() else None)
    for proc in procs:
        try:
            log.info("terminating leftover pid %d (%s) of job %s", proc.pid, " ".join(proc.cmdline())[:200], job_id)
            proc.terminate()
        except psutil.Error:
            pass
    _gone, alive = psutil.wait_procs(procs, timeout=config.kill_wait_s)
    for proc in alive:
        try:
            log.warning("killing pid %d of job %s (ignored SIGTERM)", proc.pid, job_id)
            proc.kill()
        except psutil.Error:
            pass
    directory = job_dir(config, job_id)
    if directory.exists():
        shutil.rmtree(directory, ignore_errors=True)
        log.info("removed %s", directory)
    log.info("cleaned job %s: %d leftover processes", job_id, len(procs))
    return 0


def main() -> int:
    try:
        return run(load_hook_config())
    except Exception:
        import logging

        logging.getLogger("epilog").exception("epilog failed; exiting 0")
        return 0


if __name__ == "__main__":
    sys.exit(main())
