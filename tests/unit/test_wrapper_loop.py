"""The step wrapper's loop around a real command: it sleeps until the command exits, a signal
comes or a heartbeat is due (no polling every few ms), reports the exit code, and forwards a
drain signal to the command."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.core.defaults import SERVER_DRAIN_GRACE_S
from slurm_elastic.errors import UnknownOnControllerError
from slurm_elastic.worker import wakeup
from slurm_elastic.worker.context import StepContext
from slurm_elastic.worker.wrapper import Flags, install_handlers, run_wrapped

CTX = StepContext(worker_id="w1", controller_url="http://controller", token="t", heartbeat_interval_s=30.0,
                  drain_signal="USR1", node="n1", gpus=(0,), step_id="1", job_id="1")


class Calls:
    def __init__(self) -> None:
        self.heartbeats: list[dict[str, Any]] = []

    def register(self, info: dict[str, Any]) -> dict[str, Any]:
        return {"action": "run", "heartbeat_interval_s": 30.0}

    def heartbeat(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.heartbeats.append(payload)
        return {}


def signal_when(marker: Path, signum: int) -> threading.Thread:
    """Send ``signum`` to this process once the command has written ``marker``."""
    def send() -> None:
        for _ in range(3000):
            if marker.exists():
                os.kill(os.getpid(), signum)
                return
            threading.Event().wait(0.01)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


def run_signalled(script: str, marker: Path, signum: int) -> tuple[int, Flags, Calls]:
    """Run ``script`` under the wrapper, with its handlers, and send this process ``signum`` once
    the script has written ``marker``; the exit code, the flags and the calls."""
    flags = Flags()
    install_handlers(flags, CTX.drain_signum)
    sender = signal_when(marker, signum)
    calls = Calls()
    code = run_wrapped([sys.executable, "-c", script], CTX, calls.register, calls.heartbeat, flags=flags)
    sender.join()
    return code, flags, calls


def beats(calls: Calls) -> list[dict[str, Any]]:
    """The heartbeats sent, without the command's pid."""
    return [{k: v for k, v in beat.items() if k != "child_pid"} for beat in calls.heartbeats]


@pytest.fixture
def handlers_restored() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def test_the_loop_sleeps_until_the_command_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    real_wait = wakeup.Wakeup.wait

    def counted(self: wakeup.Wakeup, timeout_s: float) -> None:
        waits.append(timeout_s)
        real_wait(self, timeout_s)

    monkeypatch.setattr(wakeup.Wakeup, "wait", counted)
    calls = Calls()
    code = run_wrapped([sys.executable, "-c", "import time; time.sleep(1.5); raise SystemExit(5)"], CTX,
                       calls.register, calls.heartbeat)
    assert code == 5 and calls.heartbeats == [{"exit_code": 5}]
    assert len(waits) <= 5, waits  # polling every 50 ms would have woken ~30 times


def test_a_drain_signal_reaches_the_command(tmp_path: Path, handlers_restored: None) -> None:
    marker = tmp_path / "trapped"
    script = ("import signal, sys, time, pathlib\n"
              "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(3))\n"
              f"pathlib.Path({str(marker)!r}).touch()\n"
              "time.sleep(60)\n")
    code, flags, calls = run_signalled(script, marker, signal.SIGUSR1)
    # the controller hears first that the drain signal reached the step (it drains the worker from then)
    assert code == 3 and flags.signals_seen == [signal.SIGUSR1] and beats(calls) == [{"leaving": True, "leaving_signal": "SIGUSR1"}, {"exit_code": 3}]


def test_a_sigterm_reaches_the_command_and_its_exit_is_reported_with_it(tmp_path: Path, handlers_restored: None) -> None:
    marker = tmp_path / "started"
    script = f"import pathlib, time\npathlib.Path({str(marker)!r}).touch()\ntime.sleep(60)\n"
    code, _, calls = run_signalled(script, marker, signal.SIGTERM)  # what `scancel --signal=TERM JOB.STEP` sends
    assert code == -signal.SIGTERM and calls.heartbeats == [{"exit_code": code, "terminated_by_signal": True}]


def test_a_command_the_drain_signal_ends_before_it_handles_it_has_drained(tmp_path: Path,
                                                                             handlers_restored: None) -> None:
    """``scancel --signal=USR1 JOB`` just after a worker started: its command, still starting, has
    no handler yet and dies of the signal. That is a drain with nothing to hand over (exit 0), not
    a crash the controller would count against the GPU and relaunch."""
    marker = tmp_path / "started"
    script = f"import pathlib, time\npathlib.Path({str(marker)!r}).touch()\ntime.sleep(60)\n"  # no USR1 handler
    code, _, calls = run_signalled(script, marker, signal.SIGUSR1)
    assert code == 0 and beats(calls) == [{"leaving": True, "leaving_signal": "SIGUSR1"}, {"exit_code": 0}]


def test_a_command_killed_by_the_drain_signal_with_no_drain_asked_still_reports_it(tmp_path: Path) -> None:
    calls = Calls()
    script = "import os, signal\nos.kill(os.getpid(), signal.SIGUSR1)\n"  # not a drain: the wrapper got nothing
    code = run_wrapped([sys.executable, "-c", script], CTX, calls.register, calls.heartbeat)
    assert code == -signal.SIGUSR1 and calls.heartbeats == [{"exit_code": -signal.SIGUSR1}]


def test_a_controller_that_does_not_know_the_worker_yet_does_not_end_it() -> None:
    """A controller restarted without its state knows no worker until it lists the job's steps:
    its 404 to a heartbeat and to the re-registration that follows is waited out, not a crash
    (the step would end and be relaunched)."""
    fast = dataclasses.replace(CTX, heartbeat_interval_s=0.02)
    unknown = UnknownOnControllerError("worker w1: no live worker of that id")
    answers = {"heartbeats": 0, "registrations": 0}

    def register(info: dict[str, Any]) -> dict[str, Any]:
        answers["registrations"] += 1
        if 1 < answers["registrations"] <= 4:  # the first is the step's own, before the restart
            raise unknown
        return {"action": "run", "heartbeat_interval_s": 0.02}

    def heartbeat(payload: dict[str, Any]) -> dict[str, Any]:
        answers["heartbeats"] += 1
        if answers["registrations"] <= 4 and "exit_code" not in payload:
            raise unknown
        return {}

    code = run_wrapped([sys.executable, "-c", "import time; time.sleep(0.6)"], fast, register, heartbeat, flags=Flags())
    assert code == 0 and answers["registrations"] >= 5, answers


def test_a_command_that_cannot_start_says_why_in_its_last_report() -> None:
    calls = Calls()
    code = run_wrapped(["/nonexistent/worker", "--flag"], CTX, calls.register, calls.heartbeat, flags=Flags())
    assert code == 127 and calls.heartbeats[-1]["exit_code"] == 127
    assert calls.heartbeats[-1]["cannot_start"] == "/nonexistent/worker: No such file or directory"


def test_a_server_stopped_for_not_becoming_ready_says_so_in_its_last_report() -> None:
    server = dataclasses.replace(CTX, kind="server", start_timeout_s=0.3)
    calls = Calls()
    code = run_wrapped([sys.executable, "-c", "import time; time.sleep(30)"], server, calls.register, calls.heartbeat,
                       flags=Flags())
    assert code != 0 and calls.heartbeats[-1].get("not_ready_after_s") == 0.3, calls.heartbeats[-1:]


def test_a_server_whose_step_gets_the_drain_signal_leaves_discovery_before_its_command_hears_it(
        tmp_path: Path, handlers_restored: None) -> None:
    """An operator's ``scancel --signal=USR1`` of a server's step, or a preemption's SIGTERM in a
    burst job, reaches the wrapper first: it tells the controller (which drops the server from
    ``/endpoints``) and forwards the signal the job's ``workers.server_drain_grace_s`` later (from the
    registration's answer), so routers send it nothing new while it drains. A drain the
    controller asks for is forwarded at once (it took the server out itself)."""
    heard = tmp_path / "heard"
    script = ("import http.server, signal, sys, time, pathlib\n"
              f"def leave(*_):\n    pathlib.Path({str(heard)!r}).write_text(repr(time.time()))\n    sys.exit(3)\n"
              "signal.signal(signal.SIGUSR1, leave)\n"
              "http.server.HTTPServer(('', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()\n")
    server = dataclasses.replace(CTX, kind="server", start_timeout_s=30.0)
    ready = threading.Event()

    class ServerCalls(Calls):
        def register(self, info: dict[str, Any]) -> dict[str, Any]:
            if info.get("ready"):
                ready.set()
            return {**super().register(info), "server_drain_grace_s": 0.4}  # the job's workers.server_drain_grace_s

        def heartbeat(self, payload: dict[str, Any]) -> dict[str, Any]:
            self.heartbeats.append({**payload, "at": time.time()})
            return {}

    def signal_once_ready() -> None:
        if ready.wait(30):
            os.kill(os.getpid(), signal.SIGUSR1)

    flags, calls = Flags(), ServerCalls()
    install_handlers(flags, CTX.drain_signum)
    sender = threading.Thread(target=signal_once_ready, daemon=True)
    sender.start()
    code = run_wrapped([sys.executable, "-c", script, "{port}"], server, calls.register, calls.heartbeat, flags=flags)
    sender.join()
    leaving = [h for h in calls.heartbeats if h.get("leaving")]
    assert code == 3 and len(leaving) == 1, calls.heartbeats
    assert 0.35 <= float(heard.read_text()) - leaving[0]["at"] < SERVER_DRAIN_GRACE_S  # the job's grace, not 1 s


def test_the_exit_code_waits_for_a_restarting_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command exits while no controller answers (it restarts): the wrapper offers the exit
    code until one does, so the successor learns how the step ended. Before, one try, and the
    successor counted a clean exit as a crash against the GPU."""
    from slurm_elastic.errors import ControllerUnreachableError
    from slurm_elastic.worker import wrapper

    monkeypatch.setattr(wrapper, "FINAL_RETRY_S", 0.0)
    tries: list[dict[str, Any]] = []

    def heartbeat(payload: dict[str, Any]) -> dict[str, Any]:
        tries.append(payload)
        if len(tries) < 4:
            raise ControllerUnreachableError("connection refused", not_connected=True)
        return {}

    wrapper._final(heartbeat, 0)
    assert [t["exit_code"] for t in tries] == [0, 0, 0, 0]
    tries.clear()
    wrapper._final(heartbeat, 143, terminated=True)  # a SIGTERM (scancel of the job): one try, no waiting
    assert len(tries) == 1
    tries.clear()
    state_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"se-final-{os.getpid()}"
    state_dir.mkdir(exist_ok=True)
    (state_dir / "controller.json").write_text('{"url": "http://x:1", "stopped_by_operator_at": 1.0}')
    wrapper._final(heartbeat, 0, state_dir=state_dir)  # a stopped controller: no waiting for it
    assert len(tries) == 1
    (state_dir / "controller.json").unlink()
    state_dir.rmdir()
