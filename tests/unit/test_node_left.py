"""A node that leaves the running job (a failed node of a ``--no-kill`` job): the controller reads the
job's nodes every ALLOCATION_CHECK_S and at the tick after a worker step ended unasked, and stops
using what left. The real node failure is in tests/cluster/test_node_failure.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.control_plane import UnknownWorkerError
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.defaults import ALLOCATION_CHECK_S, STEP_END_SETTLE_S
from slurm_elastic.core.health import AgentReport, GpuSample
from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.parse import StepInfo
from slurm_elastic.status_view import render_status
from tests.stub_backend import ListedSteps

GPUS = {"node1": (0, 1), "node2": (0, 1)}


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def make_controller(tmp: Path) -> tuple[Controller, ListedSteps, Clock]:
    config = parse_config({"autoscaler": {"min_workers": 0}, "workers": {"backoff_base_s": 1.0}})
    backend, clock = ListedSteps(), Clock()
    backend.job_nodes = ("node1", "node2")
    controller = Controller(config, 1, backend, tmp, gpus_by_node=dict(GPUS), clock=clock)  # type: ignore[arg-type]
    for node in GPUS:
        controller.report_gpu_health(AgentReport(node, clock.now_s, "inject",
                                                 [GpuSample(node, i, memory_total_mb=80_000, memory_used_mb=0,
                                                            temperature_c=40.0, clock_event_reasons=frozenset())
                                                  for i in GPUS[node]]))
    return controller, backend, clock


def test_a_node_slurm_took_out_gets_nothing_more_and_status_names_it(tmp_path: Path) -> None:
    controller, backend, clock = make_controller(tmp_path)
    controller.cordon("node2", 1, "flaky fan")
    controller.tick()
    assert backend.job_info_calls == 0  # not before ALLOCATION_CHECK_S

    backend.job_nodes = ("node1",)
    clock.now_s += ALLOCATION_CHECK_S
    controller.tick()

    assert controller.gpus_by_node == {"node1": (0, 1)}
    status = controller.status()
    assert status["left_nodes"] == [{"node": "node2", "gpus": 2, "at_s": clock.now_s}]
    assert status["cordoned_gpus"] == [] and "node2" not in status["unknown_health_nodes"]
    with pytest.raises(UnknownWorkerError):  # its agent is no longer the job's
        controller.report_gpu_health(AgentReport("node2", clock.now_s, "inject", []))
    clock.now_s += 120
    text = render_status(1, {"controller": controller.status()}, now_s=clock.now_s)
    assert "node node2 left the job 2m ago (failed, or the job shrunk): its 2 GPUs get no more workers" in text


def test_a_worker_step_that_ends_unasked_makes_the_next_tick_read_the_nodes(tmp_path: Path) -> None:
    controller, backend, clock = make_controller(tmp_path)
    controller.scale(4)
    controller.tick()
    for i, worker_id in enumerate(sorted(controller.workers)):
        node = "node1" if i < 2 else "node2"
        backend.steps.append(StepInfo(1, str(i), worker_step_name(worker_id), (node,), "0:01", "", "gres/gpu:1", 1))
    controller.tick()
    assert backend.job_info_calls == 0

    backend.steps = [s for s in backend.steps if s.nodes != ("node2",)]  # node2 failed: its steps are gone
    backend.job_nodes = ("node1",)
    controller.tick()  # sees the crashes
    controller.tick()  # reads the job's nodes

    assert backend.job_info_calls == 1 and controller.gpus_by_node == {"node1": (0, 1)}
    assert [left["node"] for left in controller.status()["left_nodes"]] == ["node2"]

    clock.now_s += STEP_END_SETTLE_S
    controller.tick()  # node2's workers crash, but its GPUs are no longer the job's to count against
    assert sum(w.crash_count for w in controller.workers.values()) == 2
    assert not any(key[0] == "node2" for key in controller.state.cordons._gpus)


def test_slurm_not_answering_keeps_the_nodes_and_says_so(tmp_path: Path) -> None:
    controller, backend, clock = make_controller(tmp_path)

    def fails(job_id: int) -> None:
        raise SlurmError("squeue: timed out")
    backend.job_info = fails  # type: ignore[assignment,method-assign]
    clock.now_s += ALLOCATION_CHECK_S
    controller.tick()

    assert controller.gpus_by_node == GPUS and controller.status()["left_nodes"] == []
    assert controller.status()["errors"][-1]["where"] == "allocation"


def test_a_restarted_controller_still_names_the_node_that_left(tmp_path: Path) -> None:
    controller, backend, clock = make_controller(tmp_path)
    backend.job_nodes = ("node1",)
    clock.now_s += ALLOCATION_CHECK_S
    controller.tick()
    left = controller.status()["left_nodes"]

    config = parse_config({"autoscaler": {"min_workers": 0}})
    restarted = Controller(config, 1, backend, tmp_path, gpus_by_node={"node1": (0, 1)},  # type: ignore[arg-type]
                           clock=clock)
    assert restarted.status()["left_nodes"] == left == [{"node": "node2", "gpus": 2, "at_s": clock.now_s}]
    requeued_onto_it = Controller(config, 1, backend, tmp_path, gpus_by_node=dict(GPUS),  # type: ignore[arg-type]
                                  clock=clock)
    assert requeued_onto_it.status()["left_nodes"] == []  # the node is the job's again


def test_a_damaged_left_nodes_record_is_noted_and_not_restored(tmp_path: Path) -> None:
    controller, _backend, _clock = make_controller(tmp_path)
    controller.save()
    body = json.loads((tmp_path / "state.json").read_text())
    body["state"]["left_nodes"] = [{"node": "node2", "gpus": "four", "at_s": 1.0}]
    (tmp_path / "state.json").write_text(json.dumps(body))
    restarted, _, _ = make_controller(tmp_path)
    assert restarted.status()["left_nodes"] == []
    assert any("left_nodes" in note for note in restarted.state_notes)


def test_a_job_comment_someone_overwrote_is_set_back_and_said(tmp_path: Path) -> None:
    """The comment names the state directory for the CLI, the epilog and a restarted controller."""
    controller, backend, clock = make_controller(tmp_path)
    backend.comment = "my own note"
    clock.now_s += ALLOCATION_CHECK_S
    controller.tick()
    assert backend.comment == f"slurm-elastic:{tmp_path}"
    [error] = [e["error"] for e in controller.status()["errors"] if e["where"] == "comment"]
    assert "'my own note'" in error

    def refuse(job_id: int, comment: str) -> None:
        raise SlurmError("scontrol: Access/permission denied")

    backend.comment = ""
    backend.set_job_comment = refuse  # type: ignore[method-assign]
    clock.now_s += ALLOCATION_CHECK_S
    controller.tick()  # a refusal is shown, never fatal, and tried again at each check
    assert "permission denied" in controller.status()["errors"][-1]["error"]
    clock.now_s += ALLOCATION_CHECK_S
    controller.tick()  # the same refusal again: not said again
    assert [e["where"] for e in controller.status()["errors"]].count("comment") == 2


def test_an_agent_report_takes_in_only_the_jobs_gpus_on_its_node(tmp_path: Path) -> None:
    """An agent that sees the whole node (or lies) cannot cordon a GPU the job does not hold: such
    a cordon could not be lifted (uncordon answers 404 for it) and would outlive restarts."""
    controller, _backend, clock = make_controller(tmp_path)
    bad = [GpuSample("node1", i, ecc_uncorrectable_volatile=5 if i else 0, memory_total_mb=80_000,
                     memory_used_mb=0, temperature_c=40.0, clock_event_reasons=frozenset()) for i in (0, 1, 7, 1000)]
    answer = controller.report_gpu_health(AgentReport("node1", clock.now_s, "nvml", bad))
    assert answer["ignored_gpus"] == [7, 1000]
    assert [(c["node"], c["gpu"]) for c in answer["changes"]] == [("node1", 1)]  # the job's GPU 1 only
    assert {(g["node"], g["gpu"]) for g in controller.status()["cordoned_gpus"]} == {("node1", 1)}
    good = [GpuSample("node1", i, memory_total_mb=80_000, memory_used_mb=0, temperature_c=40.0,
                      clock_event_reasons=frozenset()) for i in (0, 1)]
    assert "ignored_gpus" not in controller.report_gpu_health(AgentReport("node1", clock.now_s, "nvml", good))



def test_a_cordon_kept_for_a_gpu_outside_the_job_goes_at_the_next_report(tmp_path: Path) -> None:
    """One an agent's report made before the job's GPUs were checked (kept in the state file)."""
    controller, _backend, clock = make_controller(tmp_path)
    stray = GpuSample("node1", 9, ecc_uncorrectable_volatile=5, memory_total_mb=80_000, memory_used_mb=0,
                      temperature_c=40.0, clock_event_reasons=frozenset())
    good = [GpuSample("node1", i, memory_total_mb=80_000, memory_used_mb=0, temperature_c=40.0,
                      clock_event_reasons=frozenset()) for i in (0, 1)]
    controller.state.cordons.observe([*good, stray], clock.now_s)
    assert set(controller.state.cordons.cordoned()) == {("node1", 9)}
    controller.report_gpu_health(AgentReport("node1", clock.now_s, "nvml", good))
    assert controller.state.cordons.cordoned() == {}
