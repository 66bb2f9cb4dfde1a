"""``slurm-elastic worker -- CMD ...``: runs any worker command as a drain-safe, heart-beating step.

The wrapper registers with the controller (which answers ``run``, or ``hold`` when the step
landed on a cordoned GPU: the step then only holds the GPU as a placeholder), starts CMD,
heart-beats for it, and makes sure CMD learns about a drain: ``scancel --signal`` reaches only
the step's task process (this wrapper), so the wrapper forwards the drain signal to CMD, once,
whether it came as a signal or as the controller's answer to a heartbeat (a lost signal). When
CMD exits, the wrapper reports the exit code and exits with it.

In a multi-node step every task runs this wrapper; only task 0 (``SLURM_PROCID`` 0) is the worker
(registration, heartbeats, readiness, the endpoint). The others report their node and GPUs once
(:func:`run_secondary`), run CMD beside it, forward the drain signal (``scancel --signal`` reaches
every task of the step) and exit with CMD's code.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_elastic.client.answers import paced_interval_s
from slurm_elastic.client.files import stopped_by_operator_at
from slurm_elastic.client.refusals import TokenRefusals, is_token_refusal
from slurm_elastic.core.defaults import SERVER_DRAIN_GRACE_S
from slurm_elastic.errors import ApiError, ControllerUnreachableError, SlurmElasticError
from slurm_elastic.worker.context import WORKER_STEP_ENV, StepContext, node_address
from slurm_elastic.worker.liveness import LivenessProbe, probe_server
from slurm_elastic.worker.wakeup import Wakeup

log = logging.getLogger(__name__)

Call = Callable[[dict[str, Any]], dict[str, Any]]

READINESS_POLL_S = 0.05  # how often a starting server's readiness is probed
LIVENESS_POLL_S = 0.5  # how soon a liveness probe's new verdict goes out
IDLE_WAKE_S = 1.0  # the loop's longest sleep when nothing wakes it
FINAL_REPORT_S = 15.0  # how long the exit code is offered to a controller that does not answer (one restarting)
FINAL_RETRY_S = 0.5


@dataclass
class Flags:
    """Set by signal handlers (and nothing else happens in them)."""

    drain: threading.Event = field(default_factory=threading.Event)
    terminate: threading.Event = field(default_factory=threading.Event)
    signals_seen: list[int] = field(default_factory=list)


def _leaving(child_pid: int, flags: Flags) -> dict[str, Any]:
    """The heartbeat that says a drain signal reached the step, naming the first signal seen."""
    payload: dict[str, Any] = {"child_pid": child_pid, "leaving": True}
    if flags.signals_seen:
        payload["leaving_signal"] = signal.Signals(flags.signals_seen[0]).name
    return payload


def install_handlers(flags: Flags, drain_signum: int, term_drains: bool = False) -> None:
    """``term_drains`` (steps in burst jobs): the first SIGTERM is a drain, not a stop. Slurm sends
    SIGTERM (no other signal) to a preempted job's steps when its GraceTime starts; a SIGTERM that
    comes while draining already stops the command."""

    def on_drain(signum: int, _frame: object) -> None:
        flags.signals_seen.append(signum)
        flags.drain.set()

    def on_terminate(signum: int, _frame: object) -> None:
        flags.signals_seen.append(signum)
        if term_drains and signum == signal.SIGTERM and not flags.drain.is_set():
            flags.drain.set()
            return
        flags.terminate.set()

    signal.signal(drain_signum, on_drain)
    signal.signal(signal.SIGTERM, on_terminate)
    signal.signal(signal.SIGINT, on_terminate)


def free_port() -> int:
    """A TCP port free on this node right now (for server workers' ``{port}``)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def register_with_retry(register: Call, info: dict[str, Any], deadline_s: float, flags: Flags) -> dict[str, Any]:
    """Register, retrying while the controller is unreachable (it may be restarting) or does not
    know this worker yet (a restarted controller knows it once it has listed the job's steps);
    the first refusal is logged at once, with the controller's words. A refused token (401, 403:
    another job's controller on the old address while this job's restarts, or a wrong token) is
    asked again too (``register`` follows ``controller.json``) until the refusals in a row have
    gone on as long as :class:`~slurm_elastic.client.refusals.TokenRefusals` allows: its ApiError."""
    delay_s, said, said_refused = 0.2, False, False
    refusals = TokenRefusals("")
    while True:
        try:
            return register(info)
        except (ControllerUnreachableError, KeyError) as exc:  # a 404 (UnknownOnControllerError) is a KeyError
            refusals.reset()
            if time.monotonic() > deadline_s or flags.terminate.is_set():
                raise
            if not said:
                log.warning("registration not answered yet, retrying for up to %.0f s: %s",
                            max(0.0, deadline_s - time.monotonic()), exc)
                said = True
            time.sleep(delay_s)
            delay_s = min(5.0, delay_s * 2)
        except ApiError as exc:
            if not is_token_refusal(exc) or refusals.count() or time.monotonic() > deadline_s \
                    or flags.terminate.is_set():
                raise
            if not said_refused:
                said_refused = True
                log.warning("registration refused (%s): a wrong token, or another job's controller on the old address "
                            "while this job's controller restarts; asking again for up to %.0f s", exc,
                            refusals.window_s)
            flags.terminate.wait(1.0)


def is_ready(port: int, http_path: str, timeout_s: float = 1.0) -> bool:
    """Readiness of a server on this node: an HTTP 2xx on ``http_path``, or a TCP connect."""
    return probe_server(port, http_path, timeout_s)


def run_wrapped(
    command: list[str],
    ctx: StepContext,
    register: Call,
    heartbeat: Call,
    flags: Flags | None = None,
    register_timeout_s: float = 300.0,
) -> int:
    """Register, then run ``command`` (or hold as a placeholder) until it exits; returns its exit code."""
    flags = flags or Flags()
    if ctx.rank > 0:
        return run_secondary(command, ctx, register, flags, register_timeout_s, heartbeat)
    port = free_port()
    info = {**ctx.registration(), "endpoint": ""}
    answer = register_with_retry(register, info, time.monotonic() + register_timeout_s, flags)
    if answer.get("action") == "hold":
        log.warning("worker %s landed on a cordoned GPU: holding it as a placeholder", ctx.worker_id)
        return _hold(ctx, register, heartbeat, flags)
    if answer.get("action") == "drain":
        return 0
    argv, env, info = launch_with_weights(command, answer.get("weights"), port, info)
    interval_s = paced_interval_s(answer, ctx.heartbeat_interval_s)
    env["SLURM_ELASTIC_HEARTBEAT_INTERVAL_S"] = str(interval_s)  # the SDK's first beats at the told pace too
    if ctx.job_id and ctx.step_id:  # the SDK's step, even inside an srun of the command's own
        env[WORKER_STEP_ENV] = f"{ctx.job_id}.{ctx.step_id}"
    wakeup = Wakeup()
    try:
        wakeup.watch_signals()
        try:
            child = subprocess.Popen(argv, env=env)
        except OSError as exc:
            log.error("cannot start worker command %s: %s", argv[0], exc)
            _final(heartbeat, 127, state_dir=ctx.state_dir, cannot_start=f"{argv[0][:512]}: {exc.strerror or exc}"[:1024])
            return 127
        wakeup.watch_exit(child)
        leave_grace_s = float(answer.get("server_drain_grace_s", SERVER_DRAIN_GRACE_S))
        info = {**info, "command_started": True}  # a later registration is not a start: no pre-start check
        return _supervise(child, ctx, register, heartbeat, flags, info, port, interval_s, wakeup, leave_grace_s)
    finally:
        wakeup.close()


def _supervise(child: subprocess.Popen[bytes], ctx: StepContext, register: Call, heartbeat: Call, flags: Flags,
               info: dict[str, Any], port: int, interval_s: float, wakeup: Wakeup,
               leave_grace_s: float = SERVER_DRAIN_GRACE_S) -> int:
    """Heart-beat for ``child``, forward a drain to it once, report its exit code; sleeps on
    ``wakeup`` (the child's exit, a signal) between heartbeats. A server's own drain signal is
    forwarded ``leave_grace_s`` (``workers.server_drain_grace_s``) after it has left discovery."""
    forwarded = False
    asked_to_drain = False  # by the controller (it has taken the server out of discovery itself)
    forward_at: float | None = None  # a server's own drain signal: forwarded once routers have dropped it
    next_beat = time.monotonic() + interval_s  # the registration just now was the first sign of life
    ready = ctx.kind != "server"
    ready_deadline = time.monotonic() + ctx.start_timeout_s
    liveness: LivenessProbe | None = None
    reported_failures = 0
    not_ready = False  # stopped here for not becoming ready in time
    while True:
        code = child.poll()
        if code is not None:
            if liveness is not None:
                liveness.stop()
            code = drained_exit(code, ctx, flags)
            _final(heartbeat, code, terminated=any(s in (signal.SIGTERM, signal.SIGINT) for s in flags.signals_seen),
                   not_ready_after_s=ctx.start_timeout_s if not_ready else None, state_dir=ctx.state_dir)
            return code
        if not ready and is_ready(port, ctx.readiness_path):
            ready = True
            info = {**info, "ready": True, "endpoint": f"http://{node_address()}:{port}"}
            log.info("worker %s: server ready at %s", ctx.worker_id, info["endpoint"])
            try:
                register(info)
            except (KeyError, SlurmElasticError) as exc:
                log.warning("could not report readiness: %s", exc)
                ready = False
            else:
                liveness = _start_liveness(ctx, port)
        elif not ready and time.monotonic() > ready_deadline:
            log.error("worker %s: server not ready after %g s; stopping it", ctx.worker_id, ctx.start_timeout_s)
            child.terminate()
            ready_deadline, not_ready = float("inf"), True
        if flags.terminate.is_set():
            child.send_signal(signal.SIGTERM)
            flags.terminate.clear()
        now = time.monotonic()
        failures = liveness.failures if liveness is not None else 0
        if now >= next_beat or failures != reported_failures:  # a probe's verdict goes out at once
            reported_failures = failures
            payload: dict[str, Any] = {"child_pid": child.pid}
            if liveness is not None:
                payload["liveness_failures"] = failures
            reply = _beat(ctx, register, heartbeat, payload, info)
            interval_s = paced_interval_s(reply, interval_s)
            next_beat = now + interval_s
            if reply.get("drain"):
                flags.drain.set()  # the controller wants a drain, whether or not a signal came
                asked_to_drain = True
        if flags.drain.is_set() and not forwarded and ready and ctx.kind == "server" and not asked_to_drain:
            if forward_at is None:  # the signal came to the step (an operator, a preemption): routers first
                _beat(ctx, register, heartbeat, _leaving(child.pid, flags), info)
                forward_at = time.monotonic() + leave_grace_s
            if time.monotonic() < forward_at:
                wakeup.wait(min(READINESS_POLL_S, forward_at - time.monotonic()))
                continue
        if flags.drain.is_set() and not forwarded and ctx.kind != "server" and not asked_to_drain:
            _beat(ctx, register, heartbeat, _leaving(child.pid, flags), info)  # it drains from now
        if flags.drain.is_set() and not forwarded:
            log.info("worker %s: draining; forwarding SIG%s to the worker command", ctx.worker_id, ctx.drain_signal)
            child.send_signal(ctx.drain_signum)
            forwarded = True
        sleep_s = min(IDLE_WAKE_S, next_beat - time.monotonic())
        if not ready:
            sleep_s = min(sleep_s, READINESS_POLL_S)
        elif liveness is not None:
            sleep_s = min(sleep_s, LIVENESS_POLL_S)
        wakeup.wait(sleep_s)


def run_secondary(command: list[str], ctx: StepContext, register: Call, flags: Flags,
                  register_timeout_s: float = 300.0, heartbeat: Call | None = None) -> int:
    """A task above rank 0 of a multi-node step: report where it is, run CMD, forward a drain or
    a SIGTERM to it, exit with its code (no heartbeats: rank 0 speaks for the step). A CMD that
    fails on its own (no signal came first) is reported before the exit: srun then stops the
    step's other tasks with a SIGTERM, and the controller counts a crash, not a cancel."""
    answer = register_with_retry(register, ctx.registration(), time.monotonic() + register_timeout_s, flags)
    if answer.get("action") in ("hold", "drain"):  # a placeholder's other nodes only hold their GPUs
        while not flags.terminate.is_set() and not flags.drain.is_set():
            flags.terminate.wait(0.2)
        return 0
    argv, env, _ = launch_with_weights(command, answer.get("weights"), free_port(), {})
    try:
        child = subprocess.Popen(argv, env=env)
    except OSError as exc:
        log.error("cannot start worker command %s: %s", argv[0], exc)
        return 127
    forwarded = stopped = False
    while (code := child.poll()) is None:
        if flags.terminate.is_set():
            child.send_signal(signal.SIGTERM)
            flags.terminate.clear()
            stopped = True
        if flags.drain.is_set() and not forwarded:
            child.send_signal(ctx.drain_signum)
            forwarded = True
        time.sleep(0.05)
    code = drained_exit(code, ctx, flags)
    if code != 0 and not (stopped or forwarded or flags.signals_seen or flags.terminate.is_set()) and heartbeat:
        try:
            heartbeat({"rank": ctx.rank, "exit_code": max(-255, min(255, code))})
        except (KeyError, SlurmElasticError) as exc:
            log.warning("could not report exit code %d of task %d: %s", code, ctx.rank, exc)
    return code


def drained_exit(code: int, ctx: StepContext, flags: Flags) -> int:
    """0 for a command that a drain ended by the drain signal itself: it had no handler for it (yet:
    it was starting). A drain was asked and the queue holds all it handed over, so that end is a
    drain, not a crash. Any other exit code as it is."""
    if flags.drain.is_set() and code == -ctx.drain_signum:
        log.info("worker %s: the command ended on the drain signal, which it did not handle (yet): "
                 "a drain, reported as exit 0", ctx.worker_id)
        return 0
    return code


def launch_with_weights(command: list[str], weights: dict[str, Any] | None, port: int,
                        info: dict[str, Any]) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """(argv, environment, registration) for the worker command. The latest published weights the
    controller answered at registration fill ``{weights_path}`` and ``{weights_version}`` and the
    environment (``SLURM_ELASTIC_WEIGHTS_PATH``, ``_VERSION``); a command that names
    ``{weights_path}`` starts on them, so its ready registration reports that version (else the
    controller updates the server through its hook before it enters discovery)."""
    values = {"port": str(port), "weights_path": "", "weights_version": ""}
    env = {**os.environ, "SLURM_ELASTIC_PORT": str(port)}
    if weights:
        values.update(weights_path=str(weights["ref"]), weights_version=str(int(weights["version"])))
        env.update(SLURM_ELASTIC_WEIGHTS_PATH=values["weights_path"], SLURM_ELASTIC_WEIGHTS_VERSION=values["weights_version"])
        if any("{weights_path}" in part for part in command):
            info = {**info, "weights_version": int(weights["version"])}
    argv = list(command)
    for key, value in values.items():
        argv = [part.replace("{" + key + "}", value) for part in argv]
    return argv, env, info


def _start_liveness(ctx: StepContext, port: int) -> LivenessProbe | None:
    """Probe a ready server from now on (servers with a failure threshold only)."""
    if ctx.kind != "server" or ctx.liveness_failure_threshold <= 0:
        return None
    return LivenessProbe(port, ctx.liveness_path, ctx.liveness_interval_s, ctx.liveness_timeout_s,
                         name=ctx.worker_id).start()


def _hold(ctx: StepContext, register: Call, heartbeat: Call, flags: Flags) -> int:
    info, interval_s = ctx.registration(), ctx.heartbeat_interval_s
    while not flags.terminate.is_set() and not flags.drain.is_set():
        interval_s = paced_interval_s(_beat(ctx, register, heartbeat, {"placeholder": True}, info), interval_s)
        flags.terminate.wait(interval_s)
    _final(heartbeat, 0, terminated=flags.terminate.is_set(), state_dir=ctx.state_dir)
    return 0


def _beat(ctx: StepContext, register: Call, heartbeat: Call, payload: dict[str, Any],
          info: dict[str, Any]) -> dict[str, Any]:
    """One heartbeat; re-registers if the controller forgot us (a restart without state). Never
    raises: a restarted controller that has not listed the job's steps yet knows no worker (its
    404 then), and adopts this one at its next listing."""
    try:
        reply = heartbeat(payload)
        if reply.get("register") and info.get("ready", True):
            return register(info)
        return reply
    except KeyError:
        try:
            return register(info)
        except (KeyError, SlurmElasticError) as exc:
            log.warning("re-registration failed (a restarted controller that has not listed the steps yet?): %s",
                        exc)
    except SlurmElasticError as exc:
        log.warning("heartbeat failed (controller down?): %s", exc)
    return {}


def _final(heartbeat: Call, exit_code: int, terminated: bool = False, not_ready_after_s: float | None = None,
           state_dir: Path | None = None, cannot_start: str = "") -> None:
    """The exit code, whether a SIGTERM or SIGINT came first (``terminated``), and whether the
    wrapper stopped a server that was not ready after ``not_ready_after_s``; offered for up to
    ``FINAL_REPORT_S`` to a controller that does not answer (a restart: its successor learns how
    the step ended instead of guessing a crash), unless ``state_dir`` says it was stopped or a
    SIGTERM came (the job or the step is being ended: once, as Slurm's kill follows). ``cannot_start``:
    why the command could not be started (a configuration error, not its GPU's)."""
    payload = {"exit_code": exit_code, **({"terminated_by_signal": True} if terminated else {}),
               **({"cannot_start": cannot_start} if cannot_start else {}),
               **({"not_ready_after_s": not_ready_after_s} if not_ready_after_s is not None else {})}
    deadline = time.monotonic() + (0.0 if terminated else FINAL_REPORT_S)  # a SIGTERM: the job or step ends
    while True:
        try:
            heartbeat(payload)
            return
        except ControllerUnreachableError as exc:  # a controller restarting: its successor is told
            if time.monotonic() >= deadline or (state_dir and stopped_by_operator_at(state_dir) is not None):
                log.warning("could not report exit code %d: %s", exit_code, exc)
                return
            time.sleep(FINAL_RETRY_S)
        except (KeyError, SlurmElasticError) as exc:
            log.warning("could not report exit code %d: %s", exit_code, exc)
            return
