"""A server its wrapper stopped for not becoming ready in time (a model too slow to load, a bad
path), or a worker command that cannot be started at all (a wrong path): its worker backs off as
after a crash, but its GPUs are not blamed. Before, three such stops crash-cordoned every GPU of
the job within 20 s (for the command, in a live audit: 30 minutes of cordons for a typo)."""

from __future__ import annotations

from pathlib import Path

from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.slurm.parse import StepInfo
from tests.stub_backend import ListedSteps


def stop_unready_servers(tmp_path: Path, times: int, not_ready: bool,
                         last_report: dict[str, object] | None = None) -> Controller:
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0},
                           "workers": {"kind": "server", "command": ["engine", "{port}"], "backoff_base_s": 0.01,
                                       "backoff_max_s": 0.01},
                           "health": {"crash_threshold": 3}})
    backend = ListedSteps()
    now = [100.0]
    controller = Controller(config, 7, backend, tmp_path, gpus_by_node={"node1": (0,)},  # type: ignore[arg-type]
                            clock=lambda: now[0])
    controller.scale(1)
    for step in range(times):
        now[0] += 1.0  # past the backoff
        controller.tick()
        (worker_id,) = controller.workers
        backend.steps = [StepInfo(7, str(step), worker_step_name(worker_id), ("node1",), "0:01", "", "gres/gpu:1", 1)]
        controller.tick()
        controller.register_worker(worker_id, {"node": "node1", "gpus": [0], "step_id": str(step), "ready": False})
        report: dict[str, object] = dict(last_report or {"exit_code": -15})
        if not_ready:
            report["not_ready_after_s"] = 600.0
        controller.heartbeat(worker_id, report)
        backend.steps = []
        controller.tick()
    return controller


def test_a_server_never_ready_backs_off_without_cordoning_its_gpu(tmp_path: Path) -> None:
    controller = stop_unready_servers(tmp_path, 3, not_ready=True)
    (worker,) = controller.workers.values()
    assert worker.crash_count == 3 and controller.cordoned_gpus() == {}
    assert any("server not ready after 600 s" in h[3] for h in worker.history), worker.history


def test_a_server_that_crashed_three_times_still_cordons_its_gpu(tmp_path: Path) -> None:
    controller = stop_unready_servers(tmp_path, 3, not_ready=False)
    assert controller.cordoned_gpus() != {}


def test_a_command_that_cannot_start_backs_off_without_cordoning_its_gpu(tmp_path: Path) -> None:
    controller = stop_unready_servers(tmp_path, 3, not_ready=False, last_report={
        "exit_code": 127, "cannot_start": "/nonexistent/engine: No such file or directory"})
    (worker,) = controller.workers.values()
    assert worker.crash_count == 3 and controller.cordoned_gpus() == {}
    assert any("workers.command cannot start: /nonexistent/engine: No such file" in h[3] for h in worker.history)
