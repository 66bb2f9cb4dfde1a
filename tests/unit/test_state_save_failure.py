"""A state file that cannot be written (a full disk, a read-only or immutable file): an
operator's request that fails to save changes nothing, and a tick's actions run all the same."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.lifecycle import WorkerState
from slurm_elastic.slurm.backend import StepSpec
from tests.stub_backend import ListedSteps


class Launches(ListedSteps):
    def __init__(self) -> None:
        super().__init__()
        self.launched: list[str] = []

    def launch_step(self, spec: StepSpec, launcher_log: Path) -> int:
        self.launched.append(spec.name)
        return 0


def failing_saves(controller: Controller, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(state: object) -> None:
        raise PermissionError(1, "Operation not permitted", str(controller.state_file.path))
    monkeypatch.setattr(controller.state_file, "save", refuse)


def one_launched_worker(tmp_path: Path) -> tuple[Controller, str]:
    """A controller on 4 GPUs that has launched one worker (not registered yet), and its id."""
    controller = Controller(parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}}), 1,
                            Launches(), tmp_path, gpus_by_node={"node1": (0, 1, 2, 3)})
    controller.scale(1)
    controller.tick()
    (worker_id,) = controller.state.workers
    return controller, worker_id


def test_a_scale_whose_save_fails_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, `scale 3` answered 503 "storage failed" while the target changed to 3 (a live audit)."""
    controller = Controller(parse_config({"agent": {"enabled": False}}), 1, Launches(), tmp_path,
                            gpus_by_node={"node1": (0, 1, 2, 3)})
    before = (controller.state.manual_target, controller.state.paused, controller.state.wake_all_active)
    failing_saves(controller, monkeypatch)
    for request in (lambda: controller.scale(3), controller.pause, controller.wake_all, controller.resume):
        with pytest.raises(PermissionError):
            request()
        assert (controller.state.manual_target, controller.state.paused, controller.state.wake_all_active) == before


def test_a_ticks_launches_run_when_their_write_ahead_save_fails(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the tick stopped at the failed save: its new workers stayed STARTING with no srun
    for start_timeout_s (120 s), then were relaunched as crashes."""
    backend = Launches()
    controller = Controller(parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}}), 1,
                            backend, tmp_path, gpus_by_node={"node1": (0, 1, 2, 3)})
    controller.scale(2)
    failing_saves(controller, monkeypatch)
    with pytest.raises(PermissionError):  # the save after the actions fails too: the loop logs it
        controller.tick()
    assert len(backend.launched) == 2
    assert sorted(w.state for w in controller.state.workers.values()) == [WorkerState.STARTING] * 2


def test_a_worker_registers_while_the_state_file_cannot_be_written(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, its registration got 503 "storage failed" and the worker's step ended, counted as a
    crash: three such ended cordoned a healthy GPU (a live re-check with `chattr +i state.json`)."""
    controller, worker_id = one_launched_worker(tmp_path)
    failing_saves(controller, monkeypatch)
    answer = controller.register_worker(worker_id, {"node": "node1", "gpus": [0], "step_id": 3})
    assert answer["action"] == "run" and controller.state.workers[worker_id].state is WorkerState.ACTIVE


def test_a_cordon_uncordon_or_drain_whose_save_fails_changes_nothing(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, each answered 503 "storage failed" while the cordon, its lift or the drain held in
    memory (and the drain's signal was never sent)."""
    controller, worker_id = one_launched_worker(tmp_path)
    controller.register_worker(worker_id, {"node": "node1", "gpus": [0], "step_id": 3})
    controller.cordon("node1", 2, "fan noise")
    cordons_before = controller.state.cordons.to_state()
    worker_before = controller.state.workers[worker_id].to_json()
    failing_saves(controller, monkeypatch)
    for request in (lambda: controller.cordon("node1", 1, "bad"), lambda: controller.uncordon("node1", 2, "fixed"),
                    lambda: controller.drain(worker_id)):
        with pytest.raises(PermissionError):
            request()
        assert controller.state.cordons.to_state() == cordons_before
        assert controller.state.workers[worker_id].to_json() == worker_before
    assert set(controller.state.cordons.cordoned()) == {("node1", 2)}
    assert controller.state.workers[worker_id].state is WorkerState.ACTIVE
    monkeypatch.undo()
    assert controller.drain(worker_id)["state"] == "DRAINING"  # the same request, once the file can be written
