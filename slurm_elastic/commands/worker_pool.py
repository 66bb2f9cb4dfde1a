"""Commands that steer a running job's workers: scale, pause, resume, wake-all, drain, cordon, uncordon."""

from __future__ import annotations

import re
from typing import Any

import click

from slurm_elastic.client.wire import WORKER_ID
from slurm_elastic.commands.jobs import call_controller, wait_for_status
from slurm_elastic.commands.params import JOB_ID, GpuRef, Seconds, Whole
from slurm_elastic.commands.said import echo_answer, json_option
from slurm_elastic.core.limits import MAX_WORKERS
from slurm_elastic.core.naming import WORKER_PREFIX


@click.command(context_settings={"ignore_unknown_options": True})  # "-1" is a count, refused by its range
@click.argument("job_id", type=JOB_ID)
@click.argument("workers", type=Whole(0, MAX_WORKERS))
@click.option("--wait", is_flag=True, help="Wait until the job has that many active workers.")
@click.option("--timeout-s", default=300.0, show_default=True, type=Seconds(0))
@json_option
def scale(job_id: int, workers: int, wait: bool, timeout_s: float, as_json: bool) -> None:
    """Set the worker count by hand (pauses autoscaling until `resume`)."""
    echo_answer("scale", job_id, call_controller(job_id, "scale", workers), as_json)
    if wait:
        ctl = wait_for_status(job_id, lambda ctl: _settled(ctl, workers),
                              f"{workers} active workers, or a worker on every usable GPU slot", timeout_s)
        active = ctl.get("workers_by_state", {}).get("ACTIVE", 0)
        if active < workers and ctl.get("usable_slots") == 0:
            click.echo(f"none of the {workers} asked runs: no GPU slot is usable now (`slurm-elastic status "
                       f"{job_id}` lists the cordons)", err=True)
        elif active < workers:
            click.echo(f"only {active} of the {workers} asked: every usable GPU slot has a worker", err=True)


def _settled(ctl: dict[str, Any], workers: int) -> bool:
    """``workers`` are ACTIVE, or as many as the usable GPU slots allow, and none is starting or
    draining (one in BACKOFF then has no slot to come back to: it does not hold the wait)."""
    by_state = ctl.get("workers_by_state", {})
    busy = by_state.get("STARTING", 0) + by_state.get("DRAINING", 0)
    usable = ctl.get("usable_slots")  # None: no tick yet, nothing known
    return bool(by_state.get("ACTIVE", 0) == (workers if usable is None else min(workers, usable)) and busy == 0)


def _simple(name: str, method: str, doc: str) -> click.Command:
    @click.command(name=name, help=doc)
    @click.argument("job_id", type=JOB_ID)
    @json_option
    def command(job_id: int, as_json: bool) -> None:
        echo_answer(method, job_id, call_controller(job_id, method), as_json)

    return command


pause = _simple("pause", "pause", "Turn autoscaling off (the worker count stays where it is).")
resume = _simple("resume", "resume", "Turn autoscaling back on (clears a manual scale or wake-all).")
wake_all = _simple("wake-all", "wake_all", "Give every usable GPU a worker (e.g. for validation), until `resume`.")


@click.command()
@click.argument("job_id", type=JOB_ID)
@click.argument("worker_id")
@json_option
def drain(job_id: int, worker_id: str, as_json: bool) -> None:
    """Drain one worker: it finishes its rollout, hands it over and exits (replaced if still needed).
    WORKER_ID as `status` lists it (0003, or 3), or its step's name as `squeue` lists it (se-w-0003)."""
    worker_id = worker_id.removeprefix(WORKER_PREFIX)  # the step's name: se-w-0003
    if worker_id.isdigit() and not worker_id.isascii():
        raise click.BadParameter(f"{worker_id!r}: a worker's number in ASCII digits (0-9), e.g. 3 or 0003",
                                 param_hint="WORKER_ID")
    worker_id = worker_id.zfill(4) if worker_id.isdigit() else worker_id  # "3" is worker 0003
    if not re.fullmatch(WORKER_ID, worker_id):
        raise click.BadParameter(f"{worker_id!r} is not a worker id (as `status` lists them, e.g. 0003)",
                                 param_hint="WORKER_ID")
    echo_answer("drain", job_id, call_controller(job_id, "drain", worker_id), as_json)


@click.command()
@click.argument("job_id", type=JOB_ID)
@click.argument("gpu_ref", metavar="NODE:GPU", type=GpuRef())
@click.option("--reason", default="", help="Why (shown by status).")
@json_option
def cordon(job_id: int, gpu_ref: tuple[str, int], reason: str, as_json: bool) -> None:
    """Keep new workers off a GPU until an operator uncordons it."""
    node, gpu = gpu_ref
    echo_answer("cordon", job_id, call_controller(job_id, "cordon", node, gpu, reason or "cordoned by operator"),
                as_json)


@click.command()
@click.argument("job_id", type=JOB_ID)
@click.argument("gpu_ref", metavar="NODE:GPU", type=GpuRef())
@click.option("--reason", default="", help="Why (logged).")
@json_option
def uncordon(job_id: int, gpu_ref: tuple[str, int], reason: str, as_json: bool) -> None:
    """Lift an operator's, crash, prolog or pre-flight cordon; health cordons lift themselves after a
    healthy period, Slurm's when an admin resumes the node. Exits 1 when the GPU stays cordoned."""
    node, gpu = gpu_ref
    answer = call_controller(job_id, "uncordon", node, gpu, reason)
    echo_answer("uncordon", job_id, answer, as_json)
    if answer.get("cordoned"):
        click.echo(f"{node}:{gpu} stays cordoned: {answer.get('reason')}; "
                   + STILL_CORDONED.get(answer.get("source", ""), "it lifts when its cause is gone").format(node=node), err=True)
        raise SystemExit(1)
    if answer.get("lifted") == []:  # a typo'd GPU of the job, or one lifted already
        click.echo(f"{node}:{gpu} was not cordoned: nothing lifted", err=True)


STILL_CORDONED = {  # why an operator's uncordon leaves a cordon, and what lifts it
    "health": "a health cordon lifts by itself once the GPU reads healthy for the healthy period",
    "slurm": "Slurm keeps the node out of use: an admin resumes it (scontrol update nodename={node} state=resume)",
}
