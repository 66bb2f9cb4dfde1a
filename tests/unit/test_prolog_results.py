"""The controller's start-up read of the prologs' results: the job's rules, once per job, never fatal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_elastic.client.wire import report_json
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.prolog_results import MARKER_FILE, take_prolog_results
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.health import AgentReport, GpuSample
from slurm_elastic.hooks.common import HookConfig, load_hook_config
from slurm_elastic.slurm.cli_backend import SlurmCli


def controller(tmp: Path) -> Controller:
    config = parse_config({"agent": {"enabled": False}, "health": {"max_temperature_c": 70.0}})
    return Controller(config, 7, SlurmCli(), tmp / "state", gpus_by_node={"n1": (0, 1), "n2": (0, 1)})


def write_result(node_dir: Path, node: str, temperatures: list[float]) -> None:
    gpus = [GpuSample(node=node, index=i, uuid=f"GPU-{node}-{i}", temperature_c=t, clock_event_reasons=frozenset(),
                      memory_used_mb=0, memory_total_mb=1000) for i, t in enumerate(temperatures)]
    (node_dir / "7").mkdir(parents=True, exist_ok=True)
    report = report_json(AgentReport(node, 0.0, "inject", gpus, []))
    (node_dir / "7" / f"gpu-health-{node}.json").write_text(json.dumps({"report": report}))


def test_failing_gpus_are_cordoned_by_prolog_once_per_job(tmp_path: Path) -> None:
    write_result(tmp_path / "node", "n1", [40.0, 80.0])  # n2's result is not visible here
    ctl = controller(tmp_path)
    take_prolog_results(ctl, ctl.state_dir, HookConfig(node_state_dir=tmp_path / "node"))
    assert {k: v["source"] for k, v in ctl.cordoned_gpus().items()} == {("n1", 1): "prolog"}
    marker = json.loads((ctl.state_dir / MARKER_FILE).read_text())
    assert marker["nodes_read"] == ["n1"] and marker["cordoned"] == ["n1:1"] and "n2: no prolog result" in marker["problems"][0]
    ctl.uncordon("n1", 1)
    take_prolog_results(ctl, ctl.state_dir, HookConfig(node_state_dir=tmp_path / "node"))  # a restart: not again
    assert ctl.cordoned_gpus() == {}


def test_a_broken_hooks_config_does_not_stop_the_controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hooks.toml").write_text('gpus = "many"\n')
    with pytest.raises(ValueError):
        load_hook_config(tmp_path / "hooks.toml")
    monkeypatch.setattr("slurm_elastic.controller.prolog_results.load_hook_config",
                        lambda: load_hook_config(tmp_path / "hooks.toml"))
    ctl = controller(tmp_path)
    take_prolog_results(ctl, ctl.state_dir)
    assert ctl.cordoned_gpus() == {} and not (ctl.state_dir / MARKER_FILE).exists()


@pytest.mark.parametrize("text", ['strict = "false"\n', "strict = 0\n", 'strict = "no"\n'])
def test_strict_is_true_or_false_never_a_string_that_reads_as_true(tmp_path: Path, text: str) -> None:
    """`strict` drains nodes: a value that is not a TOML boolean is refused (the hooks then log it and
    exit 0), never taken as true because a non-empty string is."""
    (tmp_path / "hooks.toml").write_text(text)
    with pytest.raises(ValueError, match="strict must be true or false"):
        load_hook_config(tmp_path / "hooks.toml")
    (tmp_path / "hooks.toml").write_text("strict = true\n")
    assert load_hook_config(tmp_path / "hooks.toml").strict is True


@pytest.mark.parametrize("text", ["kill_wait_s = -5\n", "gpus = -1\n"])
def test_a_negative_number_is_refused_like_any_bad_value(tmp_path: Path, text: str) -> None:
    (tmp_path / "hooks.toml").write_text(text)
    with pytest.raises(ValueError, match="must be >= 0"):
        load_hook_config(tmp_path / "hooks.toml")
