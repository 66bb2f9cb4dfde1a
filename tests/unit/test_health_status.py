"""What status tells an operator of GPU health, from a live audit of the health path: the slots
workers keep on cordoned GPUs, and what a node's agent says is wrong."""

from __future__ import annotations

from pathlib import Path

from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.health import AgentReport, GpuSample
from slurm_elastic.status_view import render_status
from tests.stub_backend import ListedSteps, run_workers


def test_a_worker_kept_on_a_cordoned_gpu_keeps_its_slot_in_usable_slots(tmp_path: Path) -> None:
    """A cordon does not drain: before, an operator's cordon of a running worker's GPU made status
    say "only 3 GPU slots usable now" with 4 workers running and the target of 4 met."""
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"enabled": False},
                           "workers": {"initial_workers": 4}})
    backend = ListedSteps()
    controller = Controller(config, 1, backend, tmp_path, gpus_by_node={"node1": (0, 1, 2, 3)})  # type: ignore[arg-type]
    controller.tick()
    run_workers(controller, backend, 4)
    controller.tick()
    assert controller.usable_slots == 4
    controller.cordon("node1", 1, "looks odd")
    controller.tick()
    status = controller.status()
    assert status["workers_by_state"]["ACTIVE"] == 4 and status["usable_slots"] == 4
    assert "usable now" not in render_status(1, status)


def test_an_agents_errors_are_shown_until_its_report_has_none(tmp_path: Path) -> None:
    """Before, the errors of an agent's report (a drill file that does not parse) were dropped: an
    operator could not tell the file was being ignored."""
    config = parse_config({"autoscaler": {"enabled": False}})
    controller = Controller(config, 1, ListedSteps(), tmp_path, gpus_by_node={"node1": (0, 1)})  # type: ignore[arg-type]
    broken = "inject file /shared/drill.toml: Expected '=' after a key (using the last good version)"
    samples = [GpuSample("node1", i, memory_total_mb=80_000, memory_used_mb=0, temperature_c=40.0,
                         clock_event_reasons=frozenset()) for i in (0, 1)]
    controller.report_gpu_health(AgentReport("node1", 1.0, "inject", samples, [broken, "another \x1b[2J"]))
    status = controller.status()
    assert status["agent_errors"] == {"node1": [broken, "another \x1b[2J"]}
    assert f"agent on node1 reports: {broken} (and 1 more)" in render_status(1, status)
    controller.report_gpu_health(AgentReport("node1", 2.0, "inject", samples, []))
    assert controller.status()["agent_errors"] == {} and "reports:" not in render_status(1, controller.status())


def test_workers_kept_on_a_node_whose_agent_is_silent_keep_their_slots(tmp_path: Path) -> None:
    """A silent agent's node takes no new workers, and its running ones stay: status said "only 0
    GPU slots usable now" with the target of 2 met (a live audit)."""
    now = [0.0]
    config = parse_config({"autoscaler": {"enabled": False}, "workers": {"initial_workers": 2}})
    backend = ListedSteps()
    controller = Controller(config, 1, backend, tmp_path, gpus_by_node={"node1": (0, 1)},  # type: ignore[arg-type]
                            clock=lambda: now[0])
    samples = [GpuSample("node1", i, memory_total_mb=80_000, memory_used_mb=0, temperature_c=40.0,
                         clock_event_reasons=frozenset()) for i in (0, 1)]
    controller.report_gpu_health(AgentReport("node1", now[0], "inject", samples))
    controller.tick()
    run_workers(controller, backend, 2)
    controller.tick()
    assert controller.usable_slots == 2
    now[0] += 120.0  # past health.agent_silence_s: the node's health is unknown
    for number in (1, 2):
        controller.heartbeat(f"000{number}", {"busy": True})
    controller.tick()
    status = controller.status()
    assert status["unknown_health_nodes"] == ["node1"] and status["workers_by_state"]["ACTIVE"] == 2
    assert status["usable_slots"] == 2 and "usable now" not in render_status(1, status)


def test_the_agents_back_off_for_less_than_half_the_silence_bound(tmp_path: Path) -> None:
    """An agent whose reports failed through a controller outage retried up to 60 s apart, longer
    than health.agent_silence_s (30 s): a controller back from it could read the node as silent."""
    from slurm_elastic.controller.step_specs import agent_step_spec

    config = parse_config({"health": {"agent_silence_s": 40}})
    argv = agent_step_spec(config, 1, "node1", 4, controller_url="http://c:1", state_dir=tmp_path,
                           token_file=None).argv
    assert argv[argv.index("--max-backoff-s") + 1] == "20"


def test_an_operators_cordon_shows_the_health_cordon_under_it(tmp_path: Path) -> None:
    """Before, status showed only the main cordon: an operator could not tell the GPU was also
    unhealthy until `uncordon` failed on it (an operator's probe)."""
    config = parse_config({"autoscaler": {"enabled": False}, "health": {"max_temperature_c": 80}})
    controller = Controller(config, 1, ListedSteps(), tmp_path, gpus_by_node={"node1": (0, 1)})  # type: ignore[arg-type]
    controller.cordon("node1", 1, "op")
    hot = [GpuSample("node1", i, memory_total_mb=80_000, memory_used_mb=0, temperature_c=90.0 if i else 40.0,
                     clock_event_reasons=frozenset()) for i in (0, 1)]
    controller.report_gpu_health(AgentReport("node1", 1.0, "inject", hot))
    [cordon] = controller.status()["cordoned_gpus"]
    assert cordon["source"] == "operator" and [a["source"] for a in cordon["also"]] == ["health"]
    assert "op; also health: temperature_c=90" in render_status(1, controller.status())
