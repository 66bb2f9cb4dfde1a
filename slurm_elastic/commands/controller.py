"""``slurm-elastic controller --config elastic.toml`` and ``slurm-elastic worker -- CMD``."""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import click

from slurm_elastic.commands.params import JOB_ID, Seconds

log = logging.getLogger(__name__)
STOPPED_BY_SIGNAL_EXIT = 143  # 128 + SIGTERM, as a shell reports a process a SIGTERM ended


@click.command()
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="elastic.toml")
def controller(config_path: Path) -> None:
    """Run the controller inside a Slurm allocation (workers outlive it). Exit 0 after `slurm-elastic
    stop`; after SIGTERM or SIGINT, 143, so that the batch script's loop starts a new controller,
    which adopts the workers."""
    from slurm_elastic.controller.app import run_controller
    from slurm_elastic.controller.config import check_worker_command, load_config

    logging.getLogger().setLevel(logging.INFO)
    config = load_config(config_path)
    check_worker_command(config, str(config_path))
    if not run_controller(config, stop=threading.Event()):
        sys.exit(STOPPED_BY_SIGNAL_EXIT)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def worker(command: tuple[str, ...]) -> None:
    """Run CMD as a drain-safe worker step: register, heart-beat, forward the drain, report the exit."""
    from slurm_elastic.worker.step import run_step

    sys.exit(run_step(list(command)))


@click.command(name="burst-watch")
@click.option("--state-dir", required=True, type=click.Path(path_type=Path), help="The parent job's state directory.")
@click.option("--grace-s", default=300.0, show_default=True, type=Seconds(0),
              help="End after the controller is silent this long.")
@click.option("--interval-s", default=10.0, show_default=True, type=Seconds(0.1), help="Seconds between probes.")
@click.option("--parent-job-id", default=None, type=JOB_ID,
              help="End at once when the controller is silent and Slurm lists this job no more.")
def burst_watch(state_dir: Path, grace_s: float, interval_s: float, parent_job_id: int | None) -> None:
    """The batch script of a burst job: hold its GPUs; end it once the controller stays unreachable
    (or is, and the parent job has ended)."""
    from slurm_elastic.worker.burst_watch import run_watch

    logging.getLogger().setLevel(logging.INFO)
    sys.exit(run_watch(state_dir, grace_s, interval_s, parent_job_id))
