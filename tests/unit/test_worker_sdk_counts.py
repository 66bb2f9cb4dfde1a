"""The worker SDK's counts reach the controller whole: the last heartbeat goes out at close, so
the rollouts handed over after the last periodic beat (a drained worker's last ones) are counted."""

from __future__ import annotations

import signal
import sys
from typing import Any

from slurm_elastic.worker import RolloutWorker
from slurm_elastic.worker.context import StepContext
from slurm_elastic.worker.wrapper import Flags, run_wrapped


class RecordedControl:
    def __init__(self) -> None:
        self.beats: list[dict[str, Any]] = []

    def heartbeat(self, info: dict[str, Any]) -> dict[str, Any]:
        self.beats.append(info)
        return {"action": "run"}

    def close(self) -> None:
        pass


def test_close_sends_the_final_counts() -> None:
    ctx = StepContext(worker_id="0007", controller_url="http://127.0.0.1:1", token="t", heartbeat_interval_s=3600,
                      drain_signal="USR1", node="node1", gpus=(0,), step_id="3", job_id="1")
    control = RecordedControl()
    handler = signal.getsignal(signal.SIGUSR1)
    try:
        worker = RolloutWorker(ctx, control=control).start()  # type: ignore[arg-type]
        for _ in range(2):
            with worker.rollout():
                pass
        assert control.beats == []  # start() sends none, and no periodic beat within the hour
        worker.close()
    finally:
        signal.signal(signal.SIGUSR1, handler)
    assert len(control.beats) == 1 and control.beats[0]["rollouts"] == 2 and control.beats[0]["busy"] is False
    assert control.beats[0]["closing"] is True  # the last beat lets go of the worker's counts


def test_a_worker_never_started_sends_nothing_at_close() -> None:
    ctx = StepContext(worker_id="0007", controller_url="http://127.0.0.1:1", token="t", heartbeat_interval_s=3600,
                      drain_signal="USR1", node="node1", gpus=(0,), step_id="3", job_id="1")
    control = RecordedControl()
    RolloutWorker(ctx, control=control).close()  # type: ignore[arg-type]
    assert control.beats == []


def test_the_sdk_inside_an_srun_of_its_command_reports_the_workers_step(tmp_path: Any) -> None:
    """A command that starts its SDK under an srun of its own: SLURM_STEP_ID there is the inner
    step's (9), SLURM_ELASTIC_STEP (set by the wrapper) the worker's (1234.3); the SDK's beats carry
    the worker's, whose counts the controller applies."""
    token = tmp_path / "token"
    token.write_text("t" * 43)
    env = {"SLURM_ELASTIC_WORKER_ID": "0007", "SLURM_ELASTIC_CONTROLLER_URL": "http://127.0.0.1:1",
           "SLURM_ELASTIC_TOKEN_FILE": str(token), "SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "9"}
    assert StepContext.from_env({**env, "SLURM_ELASTIC_STEP": "1234.3"}).step_id == "3"
    assert StepContext.from_env(env).step_id == "9"  # not set (an SDK started by hand): Slurm's
    for odd in ("", "3", "1234.", "a.b", "1234.3.1"):  # not JOB.STEP: Slurm's
        assert StepContext.from_env({**env, "SLURM_ELASTIC_STEP": odd}).step_id == "9", odd
    ctx = StepContext.from_env({**env, "SLURM_ELASTIC_STEP": "1234.3", "SLURM_ELASTIC_HEARTBEAT_INTERVAL_S": "3600"})
    control = RecordedControl()
    handler = signal.getsignal(signal.SIGUSR1)
    try:
        RolloutWorker(ctx, control=control).start().close()  # type: ignore[arg-type]
    finally:
        signal.signal(signal.SIGUSR1, handler)
    assert control.beats[-1]["step"] == "1234.3"


def test_the_wrapper_tells_its_command_the_workers_step() -> None:
    ctx = StepContext(worker_id="0007", controller_url="http://controller", token="t", heartbeat_interval_s=5.0,
                      drain_signal="USR1", node="n1", gpus=(0,), step_id="3", job_id="1234")

    def register(info: dict[str, Any]) -> dict[str, Any]:
        return {"action": "run"}

    def heartbeat(payload: dict[str, Any]) -> dict[str, Any]:
        return {"drain": False, "hold": False, "register": False}

    script = "import os, sys; sys.exit(0 if os.environ['SLURM_ELASTIC_STEP'] == '1234.3' else 5)"
    assert run_wrapped([sys.executable, "-c", script], ctx, register, heartbeat, flags=Flags()) == 0
