"""``slurm-elastic-epilog``: after a job, kill its leftover slurm-elastic processes and clean up.

A process is this job's leftover when its environment says ``SLURM_JOB_ID=<this job>`` and marks
it as slurm-elastic's (a worker, a worker command, a controller client), it belongs to the
job's user, and it is not a Slurm daemon. Another job's processes are never touched. It then
removes the job's node-local state directory. On the first node of a slurm-elastic job (its
comment is the controller's ``slurm-elastic:<state dir>``) it cancels the job's burst jobs that
are left (named ``elastic-burst-<job>``, with the comment naming the job; one ``squeue``, and one
``scancel`` per job found). It always exits 0.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Mapping, Sequence

import psutil

from slurm_elastic.client.locate import COMMENT_PREFIX
from slurm_elastic.errors import SlurmError
from slurm_elastic.hooks.common import HookConfig, job_dir, load_hook_config, setup_logging
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.parse import expand_hostlist

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


def run(config: HookConfig, problems: Sequence[str] = ()) -> int:
    log = setup_logging(config, "epilog")
    for problem in problems:
        log.error("%s", problem)
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
    if owns_burst_jobs(os.environ):
        if config.slurm_bin_dir:  # slurmd gives hooks PATH=/bin:/usr/bin; a Slurm elsewhere is named here
            os.environ["PATH"] = os.pathsep.join([config.slurm_bin_dir, os.environ.get("PATH", "")])
        cancel_burst_jobs(int(job_id), os.environ.get("SLURM_JOB_USER", ""), log)
    return 0


def owns_burst_jobs(env: Mapping[str, str]) -> bool:
    """A slurm-elastic job (its controller set the comment), and this node is the job's first."""
    if not env.get("SLURM_JOB_COMMENT", "").startswith(COMMENT_PREFIX):
        return False
    nodes = env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    try:
        first = expand_hostlist(nodes)[:1]
    except SlurmError:
        first = []
    return not first or first[0] == env.get("SLURMD_NODENAME", "")


def cancel_burst_jobs(job_id: int, user: str, log: logging.Logger) -> list[int]:
    """Cancel the burst jobs of ``job_id`` that Slurm still lists; returns their ids."""
    try:
        left = SlurmCli(timeout_s=10).cancel_burst_jobs(job_id, user=user or None)
        for burst_id in left:
            log.info("cancelled burst job %d of ended job %d", burst_id, job_id)
    except SlurmError as exc:
        log.error("could not cancel the burst jobs of job %d: %s", job_id, exc)
        return []
    return left


def main() -> int:
    try:
        problems: list[str] = []
        return run(load_hook_config(problems=problems), problems)
    except Exception:
        logging.getLogger("epilog").exception("epilog failed; exiting 0")
        return 0


if __name__ == "__main__":
    sys.exit(main())
