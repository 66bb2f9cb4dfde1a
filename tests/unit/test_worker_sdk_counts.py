"""The worker SDK's counts reach the controller whole: the last heartbeat goes out at close, so
the rollouts handed over after the last periodic beat (a drained worker's last ones) are counted."""

from __future__ import annotations

import signal
from typing import Any

from slurm_elastic.worker import RolloutWorker
from slurm_elastic.worker.context import StepContext


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
