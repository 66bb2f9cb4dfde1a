"""Operator commands on a running job: status, wait-ready, stop; and the calls to its controller
that every operator command makes (the commands that steer its workers are in
commands/worker_pool.py)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from slurm_elastic.client.control import ControlClient, UnknownOnControllerError
from slurm_elastic.client.files import TOKEN_FILE, stopped_by_operator_at
from slurm_elastic.client.locate import (
    CONTROLLER_MAY_RUN,
    JobEndedError,
    JobHandle,
    SlurmView,
    ask_slurm,
    left_behind,
    locate_running,
)
from slurm_elastic.commands.params import JOB_ID, Seconds
from slurm_elastic.core.burst import burst_job_name, parent_of_comment
from slurm_elastic.core.naming import AGENT_PREFIX, WORKER_PREFIX
from slurm_elastic.errors import (
    ApiError,
    ControllerNotAskedError,
    ControllerUnreachableError,
    SlurmElasticError,
    SlurmError,
)
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.parse import StepInfo
from slurm_elastic.status_view import render_status, slurm_says, worker_counts

STATUS_SCHEMA_VERSION = 1
STOP_WAIT_S = 30.0  # how long a stopped controller may take to stop answering
RESTART_WAIT_S = 15.0  # an operator call refused while its job runs is tried again this long (a restart)
RESTART_RETRY_S = 0.5
CANCEL_GRACE_S = 15.0  # past the drain time: the controller cancels the steps still draining, and sees them end


def _client(job_id: int, view: SlurmView | None = None, warn: bool = True) -> tuple[JobHandle, ControlClient]:
    """A client of the job's controller once Slurm (asked here unless ``view`` says) lets one run;
    ControllerUnreachableError at once for a suspended job (its controller cannot answer)."""
    view = view if view is not None else ask_slurm(job_id, SlurmCli())
    if view.job is not None and view.job.state == "SUSPENDED":
        raise ControllerUnreachableError(f"job {job_id} is SUSPENDED: its controller answers again after "
                                         f"`scontrol resume {job_id}`")
    handle = locate_running(job_id, view)
    if view.error and warn:
        click.echo(f"warning: {_unchecked(view, handle)}", err=True)
    return handle, ControlClient(handle.url, handle.token)


class StoppedByOperatorError(SlurmElasticError):
    """The controller does not answer because an operator's ``slurm-elastic stop`` ended it."""

    def __init__(self, job_id: int, stopped_at: float) -> None:
        self.when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stopped_at))
        super().__init__(f"job {job_id}: its controller was stopped by `slurm-elastic stop` at {self.when}; the "
                         f"job's other steps run on until they end (`scancel {job_id}` frees the allocation)")


def _stopped(handle: JobHandle) -> StoppedByOperatorError | None:
    stopped_at = stopped_by_operator_at(handle.state_dir)
    return None if stopped_at is None else StoppedByOperatorError(handle.job_id, stopped_at)


def _batch_script_ended(job_id: int) -> JobEndedError | None:
    """Why a controller that refuses connections will not come back: its job is COMPLETING (the
    batch script that restarts it has ended) or has ended; None while Slurm lets it run (or does not answer)."""
    try:
        job = ask_slurm(job_id, SlurmCli()).job
    except SlurmError as exc:  # gone from Slurm's memory meanwhile
        return JobEndedError(f"job {job_id} has ended: {exc}")
    if job is None or (job.state in CONTROLLER_MAY_RUN and job.state != "COMPLETING"):
        return None
    return JobEndedError(f"job {job_id} is {job.state}: its batch script has ended, and its controller with it"
                         f"{left_behind(job_id)}")


def _token_source(handle: JobHandle) -> str:
    return f" (token read from {handle.state_dir / TOKEN_FILE})"


def _unchecked(view: SlurmView, handle: JobHandle) -> str:
    return (f"{view.error}; sending the job's token to {handle.url} on the word of "
            f"{handle.state_dir / 'controller.json'} alone")


def call_controller(job_id: int, what: str, *args: Any) -> dict[str, Any]:
    """One operator call. A controller that takes no connection while its job runs is most
    likely restarting (the batch script restarts it within seconds): the call, of which nothing
    was sent, is tried again for up to RESTART_WAIT_S."""
    handle, client = _client(job_id)
    deadline_s, said = time.monotonic() + RESTART_WAIT_S, False
    with client:
        while True:
            try:
                result: dict[str, Any] = getattr(client, what)(*args)
                return result
            except UnknownOnControllerError as exc:
                detail = str(exc.args[0] if exc.args else exc)
                raise SlurmElasticError(detail.removeprefix("unknown: ")) from None
            except ApiError as exc:
                if exc.status_code in (401, 403):  # say which token: a stale copy, another job's
                    raise SlurmElasticError(f"{exc}{_token_source(handle)}") from None
                raise
            except ControllerUnreachableError as exc:
                if (stopped := _stopped(handle)) is not None:
                    raise stopped from None
                if not exc.not_connected or time.monotonic() >= deadline_s:
                    raise
                if (ended := _batch_script_ended(job_id)) is not None:
                    raise ended from None
                if not said:
                    said = True
                    click.echo(f"controller of job {job_id} refuses connections (restarting?): trying again for "
                               f"up to {RESTART_WAIT_S:g} s", err=True)
                time.sleep(RESTART_RETRY_S)


def collect_status(job_id: int, slurm: SlurmCli | None = None) -> dict[str, Any]:
    """The status document (``--json``): controller view if reachable, else Slurm's own."""
    slurm = slurm or SlurmCli()
    view = ask_slurm(job_id, slurm)  # unknown or long-finished job ids fail here, clearly
    # Slurm itself down or hung: the controller may still answer (view.error, shown as slurm_error)
    doc: dict[str, Any] = {"schema_version": STATUS_SCHEMA_VERSION, "job_id": job_id,
                           "job_state": view.job.state if view.job else "UNKNOWN",
                           "job_exit_code": view.job.exit_code if view.job else None,
                           "job_output": view.job.output if view.job else "",
                           "job_reason": view.job.reason if view.job else "",
                           "controller_reachable": False, "controller_refused": False, "controller_not_asked": False,
                           "controller_error": "",
                           "controller": None,
                           "slurm_steps": [], "slurm_burst_jobs": [], "slurm_error": view.error}
    handle: JobHandle | None = None
    try:
        handle, client = _client(job_id, view, warn=False)
        with client:
            doc["controller"] = client.status()
        doc["controller_reachable"] = True
    except ControllerUnreachableError as exc:
        stopped = _stopped(handle) if handle else None
        doc["controller_error"] = str(stopped or exc)
        doc["controller_not_asked"] = isinstance(exc, ControllerNotAskedError)
    except ApiError as exc:  # a wrong token, say: the controller answered, but not with the status
        where = _token_source(handle) if handle and exc.status_code in (401, 403) else ""
        doc["controller_error"] = f"{exc}{where}"
        doc["controller_refused"] = True
    if not doc["controller_reachable"] and view.error:  # each listing would wait out Slurm's timeout again
        doc["controller_error"] += "; its steps and burst jobs not listed: Slurm did not answer"
    elif not doc["controller_reachable"]:
        try:
            doc["slurm_steps"] = _steps(slurm.list_steps(job_id))
        except SlurmError as exc:
            doc["controller_error"] += f"; listing steps failed too: {exc}"
        try:  # its burst jobs hold GPUs and run workers too (docs/burst.md)
            burst = [j for j in slurm.list_jobs_named(burst_job_name(job_id), user=view.job.user_name if view.job
                                                      else None) if parent_of_comment(j.comment) == job_id]
            doc["slurm_burst_jobs"] = [{"job_id": j.job_id, "state": j.state, "nodes": list(j.nodes),
                                        "reason": j.reason} for j in burst]
            running = [j.job_id for j in burst if j.state == "RUNNING"]  # Slurm lists running jobs' steps only
            doc["slurm_steps"] += _steps(slurm.list_steps_of(running)) if running else []
        except SlurmError as exc:
            doc["controller_error"] += f"; listing its burst jobs failed: {exc}"
    return doc


def _steps(steps: list[StepInfo]) -> list[dict[str, Any]]:
    return [{"step_id": s.step_ref, "name": s.name, "nodes": list(s.nodes), "time_used": s.time_used} for s in steps]


LIVE_JOB_STATES = CONTROLLER_MAY_RUN | {"UNKNOWN"}


def _render(doc: dict[str, Any]) -> str:
    warning = f"warning: {doc['slurm_error']}\n" if doc.get("slurm_error") else ""
    if not doc["controller_reachable"] and doc["job_state"] not in LIVE_JOB_STATES:
        warning += f"job {doc['job_id']} is {doc['job_state']} in Slurm{slurm_says(doc)}: no controller runs for it\n"
    if doc["controller_reachable"]:
        return warning + render_status(doc["job_id"], doc["controller"])
    return warning + render_status(doc["job_id"], None, doc["slurm_steps"], doc["controller_error"],
                                   refused=doc.get("controller_refused", False),
                                   not_asked=doc.get("controller_not_asked", False),
                                   slurm_burst_jobs=doc.get("slurm_burst_jobs", []))


@click.command()
@click.argument("job_id", type=JOB_ID)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable (schema in docs/status.md).")
@click.option("--watch", is_flag=True, help="Refresh in place until Ctrl-C (piped with --json: one JSON document a line).")
@click.option("--interval-s", default=2.0, show_default=True, type=Seconds(0.01), help="Refresh interval for --watch.")
def status(job_id: int, as_json: bool, watch: bool, interval_s: float) -> None:
    """Show a job's controller, autoscaler, buffer, workers and cordoned GPUs."""
    while True:
        doc = collect_status(job_id)
        piped = watch and not sys.stdout.isatty()
        # piped, --watch --json writes one document a line (JSON Lines: `| jq -c .workers_by_state` reads each)
        text = (json.dumps(doc, indent=None if piped else 2) + "\n") if as_json else _render(doc)
        if watch and not piped:
            click.echo("\x1b[H\x1b[2J" + text, nl=False)
        else:
            click.echo(text, nl=False)
        if not watch:
            if not doc["controller_reachable"]:
                sys.exit(3)
            return
        try:
            time.sleep(interval_s)
        except KeyboardInterrupt:
            return


def wait_for_status(job_id: int, done: Any, what: str, timeout_s: float) -> dict[str, Any]:
    """The controller's status once ``done`` says so, asked every 0.5 s and each change said;
    ClickException after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        view = ask_slurm(job_id, SlurmCli())
        try:
            handle, client = _client(job_id, view, warn=False)
            with client:
                ctl = client.status()
            if done(ctl):
                click.echo(f"done waiting for {what}", err=True)
                return ctl
            line = worker_counts(ctl) or "no workers"
            if view.error:
                line += f" (warning: {_unchecked(view, handle)})"
        except JobEndedError:
            raise
        except ControllerUnreachableError as exc:
            line = f"controller unreachable ({exc})"
        if line != last:
            click.echo(f"waiting for {what}: {line}", err=True)
            last = line
        if time.monotonic() > deadline:
            raise click.ClickException(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.5)


@click.command(name="wait-ready")
@click.argument("job_id", type=JOB_ID)
@click.option("--timeout-s", default=120.0, show_default=True, type=Seconds(0))
def wait_ready(job_id: int, timeout_s: float) -> None:
    """Wait until the job's controller answers (used by batch scripts)."""
    wait_for_status(job_id, lambda ctl: True, "the controller", timeout_s)


@click.command()
@click.argument("job_id", type=JOB_ID)
@click.option("--drain-timeout-s", default=300.0, show_default=True, type=Seconds(0),
              help="How long the workers get to finish their rollouts (use the job's workers.drain_timeout_s); "
                   "the controller stops after it, drained or not.")
def stop(job_id: int, drain_timeout_s: float) -> None:
    """Drain every worker, then stop the job's controller (end of training). Workers still there
    when the drain time is up (and the controller's cancel of their steps has had 15 s more) do
    not hold the stop back: their steps end with the job. The controller cancels its placeholders'
    steps as it stops. A controller stopped already is no error: the batch script's own stop
    follows an operator's."""
    try:
        call_controller(job_id, "scale", 0)  # tried again through a controller restart
    except StoppedByOperatorError as exc:
        click.echo(f"job {job_id}: its controller was stopped already (slurm-elastic stop, {exc.when})")
        return
    except JobEndedError as exc:  # nothing to stop; burst jobs it left (they end by themselves soon) go now
        try:
            ended = SlurmCli().cancel_burst_jobs(job_id)
        except SlurmError as slurm_exc:
            raise click.ClickException(f"{exc}; its burst jobs could not be cancelled: {slurm_exc}") from None
        click.echo(f"{exc}; nothing to stop"
                   + (f"; burst jobs {', '.join(map(str, ended))} it left were cancelled" if ended else ""))
        return
    except SlurmError as exc:  # unknown to Slurm: a wrong id, or a job long over whose burst jobs may be left
        try:
            ended = SlurmCli().cancel_burst_jobs(job_id)
        except SlurmError:
            ended = []
        if not ended:
            raise
        click.echo(f"{exc}; nothing to stop; burst jobs {', '.join(map(str, ended))} it left were cancelled")
        return
    drained = "workers drained"
    try:
        wait_for_status(job_id, lambda ctl: not any(w.get("state") in ("STARTING", "ACTIVE", "DRAINING")
                                                    and not w.get("placeholder") for w in ctl.get("workers", [])),
                        "every worker to drain", drain_timeout_s + CANCEL_GRACE_S)
    except click.ClickException as exc:
        click.echo(f"warning: {exc.message}: stopping the controller all the same (the steps left end with "
                   "the job, or `scancel` them)", err=True)
        drained = "not every worker drained in time"
    released = _stop_controller(job_id)
    slurm = SlurmCli()
    ended = slurm.cancel_burst_jobs(job_id)
    click.echo(f"job {job_id}: {drained}, controller stopped"
               + (f", placeholders {', '.join(released)} released (their steps cancelled)" if released else "")
               + (f", burst jobs {', '.join(map(str, ended))} cancelled" if ended else ""))
    left = _other_steps(slurm, job_id)
    if left:
        trainer = (" (a trainer still pulling gets `ControllerStoppedError`: no more batches come; a "
                   "`Trainer` loop that does not catch it exits non-zero, and the batch script with its status)"
                   if any("se-trainer" in step for step in left) else "")
        click.echo(f"job {job_id} still holds its allocation: steps {', '.join(left)} still run{trainer}; "
                   f"they end by themselves, or `scancel {job_id}` ends the job now", err=True)


def _other_steps(slurm: SlurmCli, job_id: int) -> list[str]:
    """The job's steps still running besides its batch script, workers and node agents (which end
    with the job): "3893.2 (trainer)"."""
    try:
        steps = slurm.list_steps(job_id)
    except SlurmError:
        return []
    return [f"{s.step_ref} ({s.name})" for s in steps
            if s.step_id.isdigit() and not s.name.startswith((WORKER_PREFIX, AGENT_PREFIX))]




def _stop_controller(job_id: int) -> list[str]:
    """Ask the controller to exit (from any host: the API) and wait until it no longer answers;
    the placeholders it released."""
    handle, client = _client(job_id)
    with client:
        released = [str(w) for w in client.stop().get("placeholders_released") or []]
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline:
            try:
                client.status()
            except ControllerUnreachableError:
                return released
            time.sleep(0.2)
    raise click.ClickException(f"the controller at {handle.url} still answers {STOP_WAIT_S:g} s after it was "
                               "asked to stop")
