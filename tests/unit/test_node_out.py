"""A node Slurm takes out of use under a running job (an admin's ``scontrol update NodeName=N
State=DRAIN``, a node set DOWN, a reboot asked for): Slurm still lets steps start there inside the
job, so the controller reads the nodes' states with the allocation and keeps new workers off them.
The real drain is in tests/cluster/test_node_drain.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.burst import burst_job_comment, burst_job_name
from slurm_elastic.core.defaults import ALLOCATION_CHECK_S
from slurm_elastic.core.health import AgentReport, GpuSample
from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.core.slurm_nodes import nodes_to_release, out_of_use_reason
from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm import cli_backend
from slurm_elastic.slurm.backend import StepSpec
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.parse import (
    FIELD_SEP,
    NodeState,
    StepInfo,
    maintenance_reasons,
    parse_node_lines,
)
from slurm_elastic.slurm.pyslurm_backend import node_state_from_pyslurm
from tests.stub_backend import ListedSteps
from tests.unit.test_burst_comment import PARENT, FakeSlurm, manager, step

GPUS = {"node1": (0, 1, 2, 3), "node2": (0, 1)}
DRAINED = NodeState("node2", "mixed+drain", "fan swap")


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class Recording(ListedSteps):
    """Lists the steps it is given; records worker launches and signals."""

    def __init__(self) -> None:
        super().__init__()
        self.launched: list[StepSpec] = []
        self.signalled: list[tuple[str, str]] = []

    def launch_step(self, spec: StepSpec, launcher_log: Path) -> int:
        if spec.name.startswith("se-w-"):  # workers, not the node agents
            self.launched.append(spec)
        return 0

    def signal_step(self, job_id: int, step_id: str, signal_name: str) -> None:
        self.signalled.append((step_id, signal_name))


def four_workers(tmp: Path, clock: Clock, health: dict[str, str] | None = None) -> tuple[Controller, Recording]:
    """Workers 0001, 0002 on node1 and 0003, 0004 on node2, registered and running; node1 has 2 GPUs free."""
    config = parse_config({"autoscaler": {"min_workers": 0}, "health": health or {}})
    backend = Recording()
    backend.job_nodes = tuple(GPUS)
    controller = Controller(config, 1, backend, tmp, gpus_by_node=dict(GPUS), clock=clock)  # type: ignore[arg-type]
    for node, gpus in GPUS.items():
        controller.report_gpu_health(AgentReport(node, clock(), "inject", [
            GpuSample(node, i, memory_total_mb=80_000, memory_used_mb=0, temperature_c=40.0,
                      clock_event_reasons=frozenset()) for i in gpus]))
    controller.scale(4)
    controller.tick()
    places = [("node1", 0), ("node1", 1), ("node2", 0), ("node2", 1)]
    for step_id, (worker_id, (node, gpu)) in enumerate(zip(sorted(controller.workers), places, strict=True)):
        backend.steps.append(StepInfo(1, str(step_id), worker_step_name(worker_id), (node,), "0:01", "", "gres/gpu:1", 1))
        controller.register_worker(worker_id, {"node": node, "gpus": [gpu], "step_id": str(step_id)})
    controller.tick()
    return controller, backend


def read_nodes(controller: Controller, clock: Clock) -> None:
    clock.now_s += ALLOCATION_CHECK_S
    controller.tick()


def test_a_drained_node_gets_no_new_worker_its_workers_drain_and_it_comes_back_on_resume(tmp_path: Path) -> None:
    clock = Clock()
    controller, backend = four_workers(tmp_path, clock)
    backend.launched.clear()
    backend.nodes["node2"] = DRAINED
    read_nodes(controller, clock)

    # the two replacements go to node1's free GPUs, never to node2
    assert len(backend.launched) == 2 and all(spec.exclude == ("node2",) for spec in backend.launched)
    status = controller.status()
    assert [(g["node"], g["gpu"], g["source"]) for g in status["cordoned_gpus"]] == [
        ("node2", 0, "slurm"), ("node2", 1, "slurm")]
    assert status["cordoned_gpus"][0]["reason"] == "Slurm marks node node2 MIXED+DRAIN: fan swap"
    drained = {w.worker_id: w for w in controller.workers.values() if w.state.value == "DRAINING"}
    assert sorted(drained) == ["0003", "0004"]
    assert {step for step, signal in backend.signalled if signal == "USR1"} == {"2", "3"}
    assert all("MIXED+DRAIN: fan swap" in w.history[-1][3] for w in drained.values())
    backend.launched.clear()
    controller.scale(8)
    controller.tick()
    assert not backend.launched  # node1 is full; node2's GPUs are free once its workers leave, and stay unused

    assert controller.uncordon("node2", 0, "not mine to lift")["cordoned"] is True  # Slurm's word stands
    backend.nodes["node2"] = NodeState("node2", "mixed", "")  # scontrol update NodeName=node2 State=RESUME
    read_nodes(controller, clock)
    assert controller.status()["cordoned_gpus"] == []


def test_keep_leaves_the_workers_running_and_still_places_none_there(tmp_path: Path) -> None:
    clock = Clock()
    controller, backend = four_workers(tmp_path, clock, {"on_node_out": "keep"})
    backend.nodes["node2"] = NodeState("node2", "mixed+drain+reboot_requested", "")
    read_nodes(controller, clock)
    assert len(controller.status()["cordoned_gpus"]) == 2
    assert [w.state.value for w in controller.workers.values()] == ["ACTIVE"] * 4
    assert not backend.signalled


def test_the_cordon_survives_a_restart_until_slurm_says_otherwise(tmp_path: Path) -> None:
    clock = Clock()
    controller, backend = four_workers(tmp_path, clock)
    backend.nodes["node2"] = DRAINED
    read_nodes(controller, clock)
    restarted = Controller(parse_config({"autoscaler": {"min_workers": 0}}), 1, backend, tmp_path,  # type: ignore[arg-type]
                           gpus_by_node=dict(GPUS), clock=clock)
    assert {(g["node"], g["source"]) for g in restarted.status()["cordoned_gpus"]} == {("node2", "slurm")}
    del backend.nodes["node2"]
    read_nodes(restarted, clock)
    assert restarted.status()["cordoned_gpus"] == []


def test_slurm_not_answering_keeps_the_cordons_as_they_were_and_says_so(tmp_path: Path) -> None:
    clock = Clock()
    controller, backend = four_workers(tmp_path, clock)
    backend.nodes["node2"] = DRAINED
    read_nodes(controller, clock)

    def fails(nodes: list[str]) -> dict[str, NodeState]:
        raise SlurmError("sinfo: timed out")
    backend.node_states = fails  # type: ignore[method-assign]
    read_nodes(controller, clock)
    assert len(controller.status()["cordoned_gpus"]) == 2
    assert controller.status()["errors"][-1] == {**controller.status()["errors"][-1], "where": "node states"}


@pytest.mark.parametrize(("state", "out"), [
    ("mixed+drain", True), ("idle+drain", True), ("allocated+drain+reboot_requested", True),
    ("down+not_responding", True), ("mixed+fail", True), ("allocated+maint", True),
    ("idle+maintenance+reserved", True), ("mixed+reserved", False),  # Slurm 22.05's words for a MAINT reservation
    ("mixed+power_down", True), ("mixed", False), ("allocated+completing", False),
    ("idle+not_responding", False), ("mixed+planned", False), ("MIXED+DRAIN", True),
])
def test_which_states_take_a_node_out(state: str, out: bool) -> None:
    assert (out_of_use_reason("n1", state, "") is not None) is out


def test_the_reason_is_said_only_when_an_admin_gave_one() -> None:
    assert out_of_use_reason("n1", "idle+drain", "none") == "Slurm marks node n1 IDLE+DRAIN"
    assert out_of_use_reason("n1", "idle+drain", " fan | swap ") == "Slurm marks node n1 IDLE+DRAIN: fan | swap"


def test_sinfo_lines_parse_with_any_reason_and_once_per_node() -> None:
    sep = FIELD_SEP
    text = (f"node1{sep}mixed{sep}none\nnode1{sep}mixed{sep}none\n"
            f"node2{sep}MIXED+DRAIN{sep}fan swap | ticket 7{sep}x\n\n")
    assert parse_node_lines(text) == {"node1": NodeState("node1", "mixed", ""),
                                      "node2": NodeState("node2", "mixed+drain", f"fan swap | ticket 7{sep}x")}


# `scontrol show reservation --oneliner` on Slurm 22.05 (the dev cluster), trimmed after State
RESERVATIONS = (
    "ReservationName=fan_swap StartTime=2026-11-27T14:24:52 EndTime=2026-11-27T16:24:52 Duration=02:00:00 "
    "Nodes=node2 NodeCnt=1 CoreCnt=16 Features=(null) PartitionName=(null) Flags=MAINT,IGNORE_JOBS,SPEC_NODES "
    "TRES=cpu=16 Users=root Groups=(null) State=ACTIVE\n"
    "ReservationName=later_work StartTime=2026-11-27T15:24:52 EndTime=2026-11-27T16:24:52 Duration=01:00:00 "
    "Nodes=node[1-2] NodeCnt=2 CoreCnt=32 Features=(null) PartitionName=(null) Flags=MAINT,SPEC_NODES "
    "TRES=cpu=32 Users=root Groups=(null) State=INACTIVE\n"
    "ReservationName=team_a StartTime=2026-11-27T14:00:00 EndTime=2026-11-28T14:00:00 Duration=1-00:00:00 "
    "Nodes=node[1-3] NodeCnt=3 Flags=SPEC_NODES Users=rl_team State=ACTIVE\n"
)


def test_a_maintenance_reservation_is_named_with_its_end() -> None:
    """Only an active reservation with Flags=MAINT: not one still to come, not a plain one."""
    assert maintenance_reasons(RESERVATIONS, ["node1", "node2"]) == {
        "node2": "maintenance reservation fan_swap until 2026-11-27T16:24:52"}
    assert maintenance_reasons("", ["node2"]) == {}
    assert maintenance_reasons("ReservationName=x Nodes=node[ State=ACTIVE Flags=MAINT", ["node2"]) == {}
    reason = out_of_use_reason("node2", "idle+maintenance+reserved", maintenance_reasons(RESERVATIONS, ["node2"])["node2"])
    assert reason == ("Slurm marks node node2 IDLE+MAINTENANCE+RESERVED: maintenance reservation fan_swap "
                      "until 2026-11-27T16:24:52")


def test_a_reservation_listing_that_fails_leaves_the_node_out_of_use_unnamed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The name is for the operator: without it the node is still out of use, and only one call is made."""
    calls: list[list[str]] = []

    def hung(argv: list[str], **_: object) -> None:
        calls.append(argv)
        raise SlurmError("scontrol timed out")

    monkeypatch.setattr(cli_backend, "run_command", hung)
    states = {"node1": NodeState("node1", "idle"), "node2": NodeState("node2", "idle+maintenance+reserved")}
    assert SlurmCli().with_maintenance_reasons(states) == states
    assert calls == [["scontrol", "show", "reservation", "--oneliner"]]
    in_use = {"node1": NodeState("node1", "idle")}
    assert SlurmCli().with_maintenance_reasons(in_use) == in_use and len(calls) == 1  # no node in maintenance: no call


def test_pyslurm_states_read_as_the_cli_reads_them() -> None:
    assert node_state_from_pyslurm("n1", "MIXED+DRAIN", None) == NodeState("n1", "mixed+drain", "")
    assert node_state_from_pyslurm("n1", None, " fan ") == NodeState("n1", "unknown", "fan")


class BurstSlurm(FakeSlurm):
    """Cancels too; job ids are never given twice."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted = 0

    def submit_batch(self, script: Path) -> int:
        self.submitted += 1
        job_id = 100 + self.submitted
        self.jobs[job_id] = (burst_job_name(PARENT), burst_job_comment(PARENT))
        return job_id

    def cancel_job(self, job_id: int) -> None:
        self.jobs.pop(job_id, None)


def test_a_burst_job_whose_nodes_slurm_drains_is_given_back_and_replaced(tmp_path: Path) -> None:
    slurm = BurstSlurm()
    made = manager(slurm, tmp_path)
    step(made, 8, {})  # the allocation's 4 slots and two burst jobs of 2
    made.observe()
    a, b = sorted(slurm.jobs)
    made.step(target_workers=8, allocation_slots=4, workers_by_job={a: 2, b: 2}, draining_by_job={}, now_s=1,
              out_of_use_jobs=frozenset({a}))
    made.observe()
    assert made.releasing == {a} and slurm.jobs[a][1] == burst_job_comment(PARENT, True)
    made.step(target_workers=8, allocation_slots=4, workers_by_job={b: 2}, draining_by_job={}, now_s=2,
              out_of_use_jobs=frozenset({a}))  # its workers have left
    made.observe()
    assert sorted(slurm.jobs) == [b, b + 1]  # a cancelled, and another asked for in its place
    assert made.counters.lost == 0 and made.counters.cancelled == 1


@pytest.mark.parametrize(("out", "steps", "released"), [
    ({"node2": "drained"}, {"node2": ["se-agent-node2"]}, ["node2"]),  # only the node agent left there
    ({"node2": "drained"}, {}, ["node2"]),
    ({"node2": "drained"}, {"node2": ["se-w-0003"]}, []),  # a worker still draining there
    ({"node2": "drained"}, {"node2": ["se-trainer"]}, []),  # the trainer, or any other step of the job
    ({"node1": "drained"}, {}, []),  # the batch host: the batch script and the controller run there
    ({"node1": "drained", "node2": "drained", "node3": "down"}, {}, ["node2", "node3"]),
])
def test_which_out_of_use_nodes_go_back_to_slurm(out: dict[str, str], steps: dict[str, list[str]],
                                                   released: list[str]) -> None:
    assert nodes_to_release(out, ("node1", "node2", "node3"), "node1", steps) == released


def test_one_node_always_stays() -> None:
    assert nodes_to_release({"node1": "x", "node2": "x"}, ("node1", "node2"), "", {}) == []


class Shrinks(Recording):
    def __init__(self) -> None:
        super().__init__()
        self.shrunk_to: list[list[str]] = []

    def shrink_job(self, job_id: int, nodes: list[str]) -> None:
        self.shrunk_to.append(list(nodes))
        self.job_nodes = tuple(nodes)


def releasing(tmp_path: Path) -> tuple[Controller, Shrinks, Clock]:
    """A controller with ``health.release_drained_nodes`` on, over GPUS, and its backend and clock."""
    clock = Clock()
    config = parse_config({"autoscaler": {"min_workers": 0}, "agent": {"enabled": False},
                           "health": {"release_drained_nodes": True}})
    backend = Shrinks()
    backend.job_nodes = tuple(GPUS)
    controller = Controller(config, 1, backend, tmp_path, gpus_by_node=dict(GPUS), clock=clock)  # type: ignore[arg-type]
    return controller, backend, clock


def test_a_drained_node_goes_back_to_slurm_once_its_workers_have_left(tmp_path: Path) -> None:
    controller, backend, clock = releasing(tmp_path)
    controller.scale(1)
    controller.tick()
    (worker_id,) = controller.workers
    backend.steps.append(StepInfo(1, "0", worker_step_name(worker_id), ("node2",), "0:01", "", "gres/gpu:1", 1))
    controller.register_worker(worker_id, {"node": "node2", "gpus": [0], "step_id": "0"})
    backend.nodes["node2"] = DRAINED
    read_nodes(controller, clock)
    assert backend.shrunk_to == []  # its worker drains first

    backend.steps.clear()  # the worker has left
    read_nodes(controller, clock)
    assert backend.shrunk_to == [["node1"]]
    controller.tick()  # the job's nodes are read again at once
    assert controller.gpus_by_node == {"node1": GPUS["node1"]}
    assert [left["node"] for left in controller.status()["left_nodes"]] == ["node2"]


def test_a_placeholder_on_a_drained_node_does_not_keep_it_from_going_back(tmp_path: Path) -> None:
    controller, backend, clock = releasing(tmp_path)
    controller.cordon("node2", 1, "ECC")
    controller.scale(1)
    controller.tick()
    (worker_id,) = controller.workers
    backend.steps.append(StepInfo(1, "0", worker_step_name(worker_id), ("node2",), "0:01", "", "gres/gpu:1", 1))
    controller.register_worker(worker_id, {"node": "node2", "gpus": [1], "step_id": "0"})  # Slurm chose the cordoned GPU
    assert controller.workers[worker_id].placeholder
    backend.nodes["node2"] = DRAINED
    read_nodes(controller, clock)
    assert backend.shrunk_to == [["node1"]]
