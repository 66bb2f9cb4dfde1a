"""``slurm-elastic burst-watch``: the batch script of a burst job. It holds the job's GPUs for the
worker steps the controller launches into it, and ends the job (exits) once the controller has not
answered an authenticated ``/healthz`` for ``grace_s``, or at once when it does not answer and
Slurm no longer lists the parent job as pending or running: a burst job never outlives its
controller by more than that, nor its parent job by more than a probe. The controller's address
and token are read from the job's state directory (on the shared file system) on every try, so a
restarted controller on a new port is found.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from slurm_elastic.client.files import TOKEN_FILE, read_controller_url, read_token_file
from slurm_elastic.errors import SlurmElasticError
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.parse import ENDED_STATES

log = logging.getLogger(__name__)


def parent_ended(parent_job_id: int, backend: SlurmCli | None = None) -> str | None:
    """Why the parent job is over ("... is CANCELLED", "... is gone"), or None while Slurm lists it
    pending or running, or cannot be asked (the grace decides then)."""
    try:
        listed = (backend or SlurmCli(timeout_s=10)).list_jobs([parent_job_id])
    except SlurmElasticError:
        return None
    if not listed:
        return f"parent job {parent_job_id} is gone from Slurm's queue"
    state = listed[0].state.split()[0]
    return f"parent job {parent_job_id} is {state}" if state in ENDED_STATES else None


def controller_answers(state_dir: Path, timeout_s: float = 5.0) -> bool:
    """True if the controller published in ``state_dir`` answers ``/healthz`` with the job's token."""
    url = read_controller_url(state_dir)
    token = read_token_file(state_dir / TOKEN_FILE)
    if not url or not token:
        return False
    try:
        response = httpx.get(f"{url.rstrip('/')}/healthz", headers={"Authorization": f"Bearer {token}"},
                             timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def watch(state_dir: Path, grace_s: float, interval_s: float, stop: threading.Event,
          answers: Callable[[Path], bool] = controller_answers, clock: Callable[[], float] = time.monotonic,
          parent_over: Callable[[], str | None] = lambda: None) -> str:
    """Probe until the controller has been silent for ``grace_s``, or is silent and ``parent_over``
    says why the parent job is over (returns why), or ``stop`` is set."""
    last_ok_s = clock()
    while not stop.is_set():
        now_s = clock()
        if answers(state_dir):
            last_ok_s = now_s
        elif (why := parent_over()) is not None:
            return f"controller unreachable and {why}: ending this burst job"
        elif now_s - last_ok_s >= grace_s:
            return f"controller unreachable for {now_s - last_ok_s:.0f} s (grace {grace_s:g} s): ending this burst job"
        stop.wait(min(interval_s, max(0.1, grace_s - (now_s - last_ok_s))))
    return "stopped"


def run_watch(state_dir: Path, grace_s: float, interval_s: float, parent_job_id: int | None = None) -> int:
    """Entry point: SIGTERM/SIGINT (the job is cancelled) stop the watch; exits 0 either way."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _s, _f: stop.set())
    reason = watch(state_dir, grace_s, interval_s, stop,
                   parent_over=(lambda: None) if parent_job_id is None else (lambda: parent_ended(parent_job_id)))
    log.warning("burst-watch: %s", reason)
    return 0
