"""Registrations are saved together: a burst of them is a few writes of the state file, each
within a second of being asked for, and none is left unwritten when the loop stops."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from slurm_elastic.client.wire import Registration
from slurm_elastic.controller.batched_saves import BatchedSaves
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.health import AgentReport, GpuSample
from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.slurm.parse import StepInfo
from slurm_elastic.worker.context import StepContext
from slurm_elastic.worker.wrapper import Flags, run_wrapped
from tests.stub_backend import ListedSteps


def wait_until(condition: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_burst_of_asks_is_one_save_within_the_wait() -> None:
    saved_at: list[float] = []
    saves = BatchedSaves(lambda: saved_at.append(time.monotonic()), wait_s=0.3)
    saves.start()
    try:
        asked_s = time.monotonic()
        for _ in range(200):
            saves.ask()
        wait_until(lambda: saved_at, 5.0)
        assert 0.25 <= saved_at[0] - asked_s < 2.0
        time.sleep(0.5)
        assert len(saved_at) == 1  # nothing asked since: nothing written
    finally:
        saves.stop()


def test_stopping_writes_what_was_asked_for_at_once() -> None:
    saved: list[int] = []
    saves = BatchedSaves(lambda: saved.append(1), wait_s=60.0)
    saves.start()
    saves.ask()
    started_s = time.monotonic()
    saves.stop()
    assert saved and time.monotonic() - started_s < 5.0


def test_an_ask_during_the_last_save_is_written_before_the_thread_ends() -> None:
    saving, go_on = threading.Event(), threading.Event()
    saved: list[int] = []

    def save() -> None:
        saving.set()
        go_on.wait(5.0)
        saved.append(1)

    saves = BatchedSaves(save, wait_s=0.01)
    saves.start()
    saves.ask()
    assert saving.wait(5.0)
    saves.ask()  # after that save read the state
    stopper = threading.Thread(target=saves.stop)
    stopper.start()
    go_on.set()
    stopper.join(5.0)
    assert len(saved) == 2


def test_a_failing_save_does_not_end_the_thread() -> None:
    calls: list[int] = []

    def save() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("disk gone")

    saves = BatchedSaves(save, wait_s=0.05)
    saves.start()
    try:
        saves.ask()
        wait_until(lambda: len(calls) == 1, 5.0)
        saves.ask()
        wait_until(lambda: len(calls) == 2, 5.0)
        assert saves.saves == 1
    finally:
        saves.stop()


def test_a_running_controller_writes_a_burst_of_registrations_a_few_times(tmp_path: Path) -> None:
    """64 workers register at once while the loop runs (its ticks 60 s apart: they write nothing
    meanwhile). Before, each registration wrote the 64-worker state under the lock."""
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0},
                           "controller": {"tick_interval_s": 60.0}})
    backend = ListedSteps()
    controller = Controller(config, 1, backend, tmp_path, gpus_by_node={f"n{i}": tuple(range(8)) for i in range(8)})  # type: ignore[arg-type]
    controller.scale(64)
    controller.tick()
    ids = sorted(controller.workers)
    for number, worker_id in enumerate(ids, start=1):
        backend.steps.append(StepInfo(1, str(number), worker_step_name(worker_id), (controller.workers[worker_id].node,),
                                      "0:01", "", "gres/gpu:1", 1))
    writes: list[int] = []
    write = controller.state_file.save
    controller.state_file.save = lambda state: (writes.append(1), write(state))[1]  # type: ignore[method-assign]
    stop = threading.Event()
    loop = threading.Thread(target=controller.run_forever, args=(stop,))
    loop.start()
    try:
        wait_until(lambda: controller.ticks >= 2, 10.0)  # the loop's first tick has begun (its own save too)
        writes.clear()

        def on_disk() -> dict[str, str]:
            workers = json.loads((tmp_path / "state.json").read_text())["state"]["workers"]
            return {k: w["state"] for k, w in workers.items()}

        for number, worker_id in enumerate(ids, start=1):
            worker = controller.workers[worker_id]
            answer = controller.register_worker(worker_id, {"node": worker.node, "gpus": list(worker.gpus),
                                                            "step_id": str(number)})
            assert answer["action"] == "run"
        registered_s = time.monotonic()
        wait_until(lambda: set(on_disk().values()) == {"ACTIVE"}, 10.0)
        assert time.monotonic() - registered_s < 3.0
        assert 1 <= len(writes) <= 4, len(writes)  # not 64
    finally:
        stop.set()
        loop.join()


def test_a_registration_without_a_running_loop_is_saved_at_once(tmp_path: Path) -> None:
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    backend = ListedSteps()
    controller = Controller(config, 1, backend, tmp_path, gpus_by_node={"n1": (0,)})  # type: ignore[arg-type]
    controller.scale(1)
    controller.tick()
    (worker_id,) = controller.workers
    backend.steps.append(StepInfo(1, "1", worker_step_name(worker_id), ("n1",), "0:01", "", "gres/gpu:1", 1))
    controller.register_worker(worker_id, {"node": "n1", "gpus": [0], "step_id": "1"})
    workers = json.loads((tmp_path / "state.json").read_text())["state"]["workers"]
    assert workers[worker_id]["state"] == "ACTIVE"


def _memory_checked_controller(tmp: Path, clock: list[float], backend: ListedSteps, kind: str = "rollout") -> Controller:
    config = parse_config({"agent": {"enabled": True}, "autoscaler": {"min_workers": 0},
                           "workers": {"command": "w", "gpu_memory_mb": 4000, "kind": kind}})
    controller = Controller(config, 1, backend, tmp, gpus_by_node={"n1": (0,)}, clock=lambda: clock[0])  # type: ignore[arg-type]
    _report_memory_used(controller, clock[0], 0)
    return controller


def _report_memory_used(controller: Controller, now_s: float, used_mb: int) -> None:
    controller.report_gpu_health(AgentReport("n1", now_s, "inject", [
        GpuSample("n1", 0, temperature_c=40.0, memory_used_mb=used_mb, memory_total_mb=80000)]))


def test_a_registration_asked_again_after_a_restart_is_not_checked_as_a_start(tmp_path: Path) -> None:
    """Killed after answering a registration and before the batched save: the successor reads the
    record as launched (STARTING), asks the running step to register again, and takes it as ACTIVE.
    The free-memory check is for a step about to start its command: run on this one (its command
    holds the memory, or no agent has reported since the restart) it cordoned the worker's own GPU,
    made the worker a placeholder and cancelled its step once the memory read free."""
    clock = [1000.0]
    backend = ListedSteps()
    first = _memory_checked_controller(tmp_path, clock, backend)
    first.scale(1)
    first.tick()
    (worker_id,) = first.workers
    backend.steps.append(StepInfo(1, "1", worker_step_name(worker_id), ("n1",), "0:01", "", "gres/gpu:1", 1))

    class NeverWrites:  # a batched save the kill came before
        def ask(self) -> None:
            pass

    first.batched_saves = NeverWrites()  # type: ignore[assignment]
    assert first.register_worker(worker_id, {"node": "n1", "gpus": [0], "step_id": "1"})["action"] == "run"
    assert json.loads((tmp_path / "state.json").read_text())["state"]["workers"][worker_id]["state"] == "STARTING"
    clock[0] += 5
    successor = Controller(first.config, 1, backend, tmp_path, gpus_by_node={"n1": (0,)}, clock=lambda: clock[0])  # type: ignore[arg-type]
    successor.tick()
    assert successor.heartbeat(worker_id, {"busy": True})["register"] is True
    answer = successor.register_worker(worker_id, {"node": "n1", "gpus": [0], "step_id": "1", "command_started": True})
    worker = successor.workers[worker_id]
    assert (answer["action"], worker.state.value, worker.placeholder) == ("run", "ACTIVE", False)
    assert successor.cordoned_gpus() == {}
    _report_memory_used(successor, clock[0], 30000)  # its command's memory
    clock[0] += 1
    assert successor.tick().actions == []


def test_a_server_that_became_ready_is_not_checked_as_a_start(tmp_path: Path) -> None:
    """A server registers before its engine starts (checked: the memory is free), then again once
    ready, its engine holding the memory: that one is no start to check."""
    clock = [1000.0]
    backend = ListedSteps()
    controller = _memory_checked_controller(tmp_path, clock, backend, kind="server")
    controller.scale(1)
    controller.tick()
    (worker_id,) = controller.workers
    backend.steps.append(StepInfo(1, "1", worker_step_name(worker_id), ("n1",), "0:01", "", "gres/gpu:1", 1))
    info = {"node": "n1", "gpus": [0], "step_id": "1", "ready": False, "endpoint": ""}
    assert controller.register_worker(worker_id, info)["action"] == "run"
    _report_memory_used(controller, clock[0], 79000)  # the engine loaded its model
    answer = controller.register_worker(worker_id, {**info, "ready": True, "endpoint": "http://n1:8000",
                                                    "command_started": True})
    worker = controller.workers[worker_id]
    assert (answer["action"], worker.state.value, worker.placeholder) == ("run", "ACTIVE", False)
    assert controller.cordoned_gpus() == {}


def test_a_start_on_a_full_gpu_is_still_held(tmp_path: Path) -> None:
    """The check itself stands for a step's first registration: a GPU another process fills is
    cordoned and the step holds it as a placeholder."""
    clock = [1000.0]
    backend = ListedSteps()
    controller = _memory_checked_controller(tmp_path, clock, backend)
    _report_memory_used(controller, clock[0], 79000)
    controller.scale(1)
    controller.tick()
    (worker_id,) = controller.workers
    backend.steps.append(StepInfo(1, "1", worker_step_name(worker_id), ("n1",), "0:01", "", "gres/gpu:1", 1))
    assert controller.register_worker(worker_id, {"node": "n1", "gpus": [0], "step_id": "1"})["action"] == "hold"


def test_the_wrapper_says_its_command_runs_when_it_registers_again() -> None:
    """The first registration comes before the command starts; one asked for by a heartbeat's
    answer (a restarted controller) says the command runs."""
    infos: list[dict[str, Any]] = []
    asked = [False]

    def register(info: dict[str, Any]) -> dict[str, Any]:
        infos.append(info)
        return {"action": "run", "heartbeat_interval_s": 0.05}

    def heartbeat(payload: dict[str, Any]) -> dict[str, Any]:
        again, asked[0] = not asked[0], True
        return {"drain": False, "hold": False, "register": again, "heartbeat_interval_s": 0.05}

    ctx = StepContext(worker_id="0001", controller_url="http://controller", token="t", heartbeat_interval_s=0.05,
                      drain_signal="USR1", node="n1", gpus=(0,), step_id="1", job_id="1")
    code = run_wrapped([sys.executable, "-c", "import time; time.sleep(0.5)"], ctx, register, heartbeat, flags=Flags())
    assert code == 0
    assert len(infos) == 2, infos
    assert not infos[0].get("command_started") and infos[1]["command_started"] is True
    assert Registration.model_validate(infos[1]).command_started  # the controller's edge takes it
