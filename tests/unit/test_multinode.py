"""Workers bigger than one node (pure core, and the controller in process): placement over whole
nodes, cordons on any node of a worker, crash accounting on all its GPUs, reattach of a step
listed with several nodes, the shape's validation, the srun line and the status cells."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.control_plane import UnknownWorkerError
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.state_model import restore_state
from slurm_elastic.core.autoscaler_config import AutoscalerConfig
from slurm_elastic.core.cordons import CordonBook
from slurm_elastic.core.defaults import STEP_END_SETTLE_S
from slurm_elastic.core.health import GpuSample, HealthRules
from slurm_elastic.core.lifecycle import Worker, WorkerState
from slurm_elastic.core.placement import Allocation, multi_node_slots, placement
from slurm_elastic.core.reconcile import Crashed, Drain, Launch, ObservedStep, ReconcileConfig
from slurm_elastic.core.scaling import Autoscaler
from slurm_elastic.core.shape import WorkerShape, shape_for_allocation, worker_shape
from slurm_elastic.core.tick import ControlState, Observation, TickConfig, tick
from slurm_elastic.errors import ConfigError
from slurm_elastic.slurm.backend import StepSpec, build_srun_argv
from slurm_elastic.slurm.parse import StepInfo
from slurm_elastic.status_view import _nodes_and_gpus
from slurm_elastic.worker.context import StepContext
from slurm_elastic.worker.wrapper import Flags, run_secondary
from tests.stub_backend import ListedSteps

S = WorkerState
TWO_NODES = Allocation(7, {"n1": (0, 1, 2, 3), "n2": (0, 1, 2, 3)})
EIGHT = TickConfig(reconcile=ReconcileConfig(), gpus_per_worker=8, nodes_per_worker=2)
ALL_N1 = tuple(("n1", g) for g in range(4))
ALL_N2 = tuple(("n2", g) for g in range(4))


def state(target: int, rules: HealthRules | None = None) -> ControlState:
    return ControlState(autoscaler=Autoscaler(AutoscalerConfig(enabled=False)), cordons=CordonBook(rules),
                        target_workers=target)


def eight_gpu_worker(**fields: Any) -> Worker:
    """An ACTIVE 8-GPU worker: rank 0 on n1 (GPUs 0-3), its other task on n2 reported GPUs 0-3."""
    values: dict[str, Any] = {"node_gpus": {"n2": (0, 1, 2, 3)}, **fields}
    return Worker("0001", state=S.ACTIVE, step_id="5", node="n1", gpus=(0, 1, 2, 3), nodes=("n1", "n2"), **values)


LISTED = (ObservedStep("0001", "5", "n1", 7, ("n1", "n2")),)


# ------------------------------------------------------------------------------ placement


def test_an_8_gpu_worker_over_two_4_gpu_nodes_is_one_slot_and_a_cordon_on_either_node_removes_it() -> None:
    assert [(s.slots, s.exclude_nodes) for s in placement((TWO_NODES,), 8, set(), nodes_per_worker=2)] == [(1, ())]
    for cordon in (("n1", 0), ("n2", 3)):
        slots = placement((TWO_NODES,), 8, {cordon}, nodes_per_worker=2)
        assert [(s.slots, s.exclude_nodes) for s in slots] == [(0, (cordon[0],))]


def test_2_gpu_workers_fit_two_per_node_or_one_share_per_node_when_spread() -> None:
    assert placement((TWO_NODES,), 2, set())[0].slots == 4  # one node each, two per node
    spread = placement((TWO_NODES,), 4, set(), nodes_per_worker=2)  # 2 GPUs on each of 2 nodes
    assert spread[0].slots == 2
    assert placement((TWO_NODES,), 4, {("n2", 0)}, nodes_per_worker=2)[0].slots == 1  # n2 keeps one share


@pytest.mark.parametrize(("shares", "k", "workers"), [
    ([2, 2], 2, 2), ([4, 0], 2, 0), ([3, 1, 1], 2, 2), ([1, 1, 1], 3, 1), ([5, 5, 5], 2, 7), ([2, 1], 1, 3)])
def test_workers_over_k_distinct_nodes(shares: list[int], k: int, workers: int) -> None:
    assert multi_node_slots(shares, k) == workers


# ------------------------------------------------------------------------------ the tick


def test_the_tick_launches_one_8_gpu_worker_however_high_the_target() -> None:
    st = state(3)
    result = tick(Observation(steps=()), st, EIGHT, (TWO_NODES,), 0.0)
    assert [(a.worker_id, a.exclude_nodes, a.job_id) for a in result.actions if isinstance(a, Launch)] == [
        ("0001", (), 7)]
    assert tick(Observation(steps=()), st, EIGHT, (TWO_NODES,), 1.0).actions == []  # launched, not listed yet


def test_2_gpu_workers_one_per_node_pair_of_gpus() -> None:
    cfg = TickConfig(reconcile=ReconcileConfig(), gpus_per_worker=2)
    result = tick(Observation(steps=()), state(9), cfg, (TWO_NODES,), 0.0)
    assert len([a for a in result.actions if isinstance(a, Launch)]) == 4


def test_a_health_cordon_on_the_second_node_drains_the_multi_node_worker() -> None:
    st = state(1, HealthRules(on_unhealthy="drain"))
    st.workers["0001"] = eight_gpu_worker()
    st.cordons.observe([GpuSample("n2", 2, temperature_c=120.0)], 0.0)
    result = tick(Observation(steps=LISTED), st, EIGHT, (TWO_NODES,), 1.0)
    assert st.workers["0001"].state is S.DRAINING
    assert "GPU n2:2 unhealthy" in st.workers["0001"].history[-1][3]
    assert Drain("0001", "5", 0) in result.actions
    assert not [a for a in result.actions if isinstance(a, Launch)]  # no room left: n2 is excluded
    assert result.slots[0].exclude_nodes == ("n2",)


def test_a_node_whose_task_has_not_reported_its_gpus_counts_any_cordon_there() -> None:
    worker = eight_gpu_worker(node_gpus={})
    assert worker.cordoned_gpus({("n2", 1), ("n3", 0)}) == [("n2", 1)]
    one_node = Worker("0002", node="n1", gpus=(1,), nodes=("n1",))
    assert one_node.cordoned_gpus({("n1", 0)}) == []  # a one-node worker: its own GPUs only


def test_an_operator_cordon_on_the_second_node_keeps_the_worker_and_launches_none_beside_it() -> None:
    st = state(2)
    st.workers["0001"] = eight_gpu_worker()
    st.cordons.cordon_manual("n2", 1, "fan", 0.0)
    result = tick(Observation(steps=LISTED), st, EIGHT, (TWO_NODES,), 1.0)
    assert st.workers["0001"].state is S.ACTIVE and result.actions == []


def test_a_multi_node_step_that_loses_a_task_counts_a_crash_on_every_gpu_of_both_nodes() -> None:
    st = state(1, HealthRules(crash_threshold=1))
    st.workers["0001"] = eight_gpu_worker()
    tick(Observation(steps=()), st, EIGHT, (TWO_NODES,), 1.0)  # gone without a word: Slurm's may follow
    result = tick(Observation(steps=()), st, EIGHT, (TWO_NODES,), 1.0 + STEP_END_SETTLE_S)
    crash = next(e for e in result.events if isinstance(e, Crashed))
    assert crash.gpu_keys == ALL_N1 + ALL_N2
    assert set(st.cordons.cordoned()) == set(ALL_N1 + ALL_N2)
    assert st.workers["0001"].state is S.BACKOFF


def test_reattach_of_a_2_node_step_from_the_listing_keeps_both_nodes_and_launches_nothing() -> None:
    st = state(0)
    st.seed_target_from_slurm = True
    result = tick(Observation(steps=LISTED), st, EIGHT, (TWO_NODES,), 0.0)
    adopted = st.workers["0001"]
    assert (adopted.node, adopted.nodes, adopted.all_nodes) == ("n1", ("n1", "n2"), ("n1", "n2"))
    assert st.target_workers == 1 and result.actions == []
    assert result.slots[0].slots == 1  # the running step holds it


def test_state_records_keep_nodes_and_older_records_default_to_one_node() -> None:
    worker = eight_gpu_worker()
    restored = restore_state({"workers": {"0001": worker.to_json(),
                                          "0002": {"worker_id": "0002", "state": "ACTIVE", "node": "n1",
                                                   "gpus": [1]}}})
    assert restored.notes == ()
    back = restored.workers["0001"]
    assert (back.nodes, back.node_gpus, back.gpu_keys) == (("n1", "n2"), {"n2": (0, 1, 2, 3)}, ALL_N1 + ALL_N2)
    old = restored.workers["0002"]
    assert (old.nodes, old.node_gpus, old.all_nodes) == ((), {}, ("n1",))


# ------------------------------------------------------------------------------ the shape and its validation


def test_the_shape_takes_whole_nodes_above_one_node() -> None:
    assert worker_shape(8, 0, 4) == WorkerShape(2, 4, 1)
    assert worker_shape(2, 0, 4) == WorkerShape(1, 2, 1)
    assert worker_shape(4, 2, 4, tasks_per_node=2) == WorkerShape(2, 2, 2)


@pytest.mark.parametrize(("gpus", "k", "words"), [
    (6, 0, ["gpus_per_worker = 6", "whole nodes of 4 GPUs", "1 to 4 or a multiple of 4 (8)"]),
    (5, 2, ["does not divide evenly over", "multiple of 2"]),
    (8, 1, ["needs 8 GPUs per node", "n1, n2", "have 4 GPUs"]),
    (12, 0, ["needs 3 nodes", "the job has 2 node(s)"]),
])
def test_shapes_the_allocation_cannot_hold_are_config_errors_naming_both(gpus: int, k: int, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        shape_for_allocation(gpus, k, 1, dict(TWO_NODES.gpus_by_node))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_the_config_file_is_checked_against_the_gpus_per_node_it_states() -> None:
    with pytest.raises(ConfigError, match=r"workers\.gpus_per_worker = 6 does not fill whole nodes of 4 GPUs"):
        parse_config({"workers": {"gpus_per_worker": 6}, "job": {"gpus_per_node": 4}})
    assert parse_config({"workers": {"gpus_per_worker": 8, "tasks_per_node": 2}}).workers.tasks_per_node == 2


def test_the_srun_line_of_a_2_node_step_asks_for_gpus_per_node_and_tasks_per_node() -> None:
    argv = build_srun_argv(StepSpec(job_id=7, name="se-w-0001", argv=("x",), output_path=Path("/o"), gpus=4,
                                    nodes=2, tasks_per_node=2))
    assert {"--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--gres=gpu:4"} <= set(argv)
    one = build_srun_argv(StepSpec(job_id=7, name="se-w-0002", argv=("x",), output_path=Path("/o")))
    assert "--nodes=1" in one and "--ntasks=1" in one and not any(a.startswith("--ntasks-per-node") for a in one)


def test_the_status_cells_name_every_node_and_its_gpus() -> None:
    row = {"node": "n1", "gpus": [0, 1], "nodes": ["n1", "n2"], "node_gpus": {}}
    assert _nodes_and_gpus(row) == ("n1,n2", "0,1+?")
    assert _nodes_and_gpus({**row, "node_gpus": {"n2": [2, 3]}}) == ("n1,n2", "0,1+2,3")
    assert _nodes_and_gpus({"node": "n1", "gpus": [3]}) == ("n1", "3")  # an older controller's answer


# ------------------------------------------------------------------------------ the controller and the wrapper


class Recorded(ListedSteps):
    def __init__(self, steps: list[StepInfo]) -> None:
        super().__init__(steps)
        self.launched: list[StepSpec] = []

    def launch_step(self, spec: StepSpec, launcher_log: Path) -> int:
        self.launched.append(spec)
        return 0


def test_the_controller_launches_a_2_node_step_and_only_rank_0_registers_the_worker(tmp_path: Path) -> None:
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"enable_elastic": False},
                           "workers": {"gpus_per_worker": 8, "initial_workers": 1, "kind": "server"}})
    backend = Recorded([])
    controller = Controller(config, 7, backend, tmp_path, gpus_by_node=dict(TWO_NODES.gpus_by_node),  # type: ignore[arg-type]
                            clock=lambda: 100.0)
    controller.tick()
    assert [(s.nodes, s.gpus, s.tasks_per_node) for s in backend.launched] == [(2, 4, 1)]
    backend.steps = [StepInfo(7, "5", "se-w-0001", ("n1", "n2"), "0:01", "", "gres/gpu:4", 2)]
    controller.tick()
    assert controller.register_worker("0001", {"node": "n2", "gpus": [0, 1, 2, 3], "rank": 1})["action"] == "run"
    assert controller.workers["0001"].state is S.STARTING  # another task: not the worker's registration
    controller.register_worker("0001", {"node": "n1", "gpus": [0, 1, 2, 3], "step_id": "5", "ready": True,
                                        "endpoint": "http://n1:9000"})
    worker = controller.workers["0001"]
    assert worker.state is S.ACTIVE and worker.gpu_keys == ALL_N1 + ALL_N2
    assert [e["url"] for e in controller.endpoints.view(100.0)["endpoints"]] == ["http://n1:9000"]
    view = controller.status()["workers"][0]
    assert (view["nodes"], view["node_gpus"]) == (["n1", "n2"], {"n2": [0, 1, 2, 3]})


def test_a_second_task_on_a_one_node_worker_is_told_to_run(tmp_path: Path) -> None:
    """``tasks_per_node = 2`` on a 1-GPU worker: task 1 sits on the worker's own node. Before (a
    live audit), its registration got 404 "its step spans one node", its wrapper retried for
    register_timeout_s (300 s) without running the command, and the step was cancelled."""
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"enable_elastic": False},
                           "workers": {"initial_workers": 1, "tasks_per_node": 2}})
    backend = Recorded([])
    controller = Controller(config, 7, backend, tmp_path, gpus_by_node={"n1": (0, 1, 2, 3)}, clock=lambda: 100.0)
    controller.tick()
    assert [(s.nodes, s.gpus, s.tasks_per_node) for s in backend.launched] == [(1, 1, 2)]
    backend.steps = [StepInfo(7, "5", "se-w-0001", ("n1",), "0:01", "", "gres/gpu:1", 2)]
    controller.tick()
    controller.register_worker("0001", {"node": "n1", "gpus": [0], "step_id": "5", "ready": True})
    assert controller.register_worker("0001", {"node": "n1", "gpus": [0], "rank": 1})["action"] == "run"
    worker = controller.workers["0001"]
    assert worker.state is S.ACTIVE and worker.gpu_keys == (("n1", 0),) and worker.nodes in ((), ("n1",))
    with pytest.raises(UnknownWorkerError, match="spans one node"):  # a task elsewhere is no task of it
        controller.register_worker("0001", {"node": "n2", "gpus": [0], "rank": 1})


def test_a_task_above_rank_0_reports_once_runs_the_command_and_forwards_the_drain(tmp_path: Path) -> None:
    reports: list[dict[str, Any]] = []
    ctx = StepContext("0001", "http://x", "", 5.0, "USR1", "n2", (0, 1), "5", "7", rank=1)
    flags = Flags()
    marker, ready = tmp_path / "drained", tmp_path / "ready"
    script = ("import signal,sys,time,pathlib\n"
              f"signal.signal(signal.SIGUSR1, lambda *a: (pathlib.Path({str(marker)!r}).touch(), sys.exit(0)))\n"
              f"pathlib.Path({str(ready)!r}).touch()\ntime.sleep(30)\nsys.exit(5)")

    def drain_once_ready() -> None:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        flags.drain.set()  # what scancel --signal does to every task's wrapper

    def register(info: dict[str, Any]) -> dict[str, Any]:
        reports.append(info)
        threading.Thread(target=drain_once_ready, daemon=True).start()
        return {"action": "run"}

    assert run_secondary([sys.executable, "-c", script], ctx, register, flags) == 0
    assert marker.exists() and [(r["rank"], r["node"], r["gpus"]) for r in reports] == [(1, "n2", [0, 1])]
    assert ctx.drain_signum == signal.SIGUSR1


@pytest.mark.parametrize(("script", "stop", "reported"), [
    ("import sys; sys.exit(3)", None, [{"rank": 1, "exit_code": 3}]),  # its own failure: said before the exit
    ("import time; time.sleep(30)", "terminate", []),  # srun's (or an operator's) SIGTERM came first
    ("import signal,sys,time; signal.signal(signal.SIGUSR1, lambda *a: sys.exit(1)); time.sleep(30)", "drain", []),
    ("import sys; sys.exit(0)", None, []),
])
def test_a_task_above_rank_0_reports_only_a_failure_of_its_own(script: str, stop: str | None,
                                                               reported: list[dict[str, Any]]) -> None:
    ctx = StepContext("0001", "http://x", "", 5.0, "USR1", "n2", (0, 1), "5", "7", rank=1)
    flags, beats = Flags(), []

    def register(info: dict[str, Any]) -> dict[str, Any]:
        if stop:
            threading.Timer(0.5, getattr(flags, stop).set).start()
        return {"action": "run"}

    def heartbeat(info: dict[str, Any]) -> dict[str, Any]:
        beats.append(info)
        return {}

    run_secondary([sys.executable, "-c", script], ctx, register, flags, heartbeat=heartbeat)
    assert beats == reported
