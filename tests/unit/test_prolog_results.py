"""The controller's start-up read of the prologs' results: the job's rules, once per job, never fatal."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_elastic.client.wire import report_json
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.prolog_results import MARKER_FILE, take_prolog_results
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.health import AgentReport, GpuSample
from slurm_elastic.hooks.common import HookConfig, load_hook_config
from slurm_elastic.slurm.cli_backend import SlurmCli

ROOT = Path(__file__).resolve().parents[2]


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
    take the default, false), never taken as true because a non-empty string is."""
    (tmp_path / "hooks.toml").write_text(text)
    with pytest.raises(ValueError, match="strict must be true or false"):
        load_hook_config(tmp_path / "hooks.toml")
    (tmp_path / "hooks.toml").write_text("strict = true\n")
    assert load_hook_config(tmp_path / "hooks.toml").strict is True


@pytest.mark.parametrize("text", ["kill_wait_s = -5\n", "gpus = -1\n", "kill_wait_s = nan\n", "kill_wait_s = inf\n"])
def test_a_negative_or_endless_number_is_refused_like_any_bad_value(tmp_path: Path, text: str) -> None:
    (tmp_path / "hooks.toml").write_text(text)
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        load_hook_config(tmp_path / "hooks.toml")


@pytest.mark.parametrize(("text", "says"), [
    ('gpus = "many"\nkill_wait_s = 1\n', "gpus must be a whole number"),
    ("strict = 1\nkill_wait_s = 1\n", "strict must be true or false"),
    ("kill_wait_s = 1\nnode_state_dir = 5\n", "node_state_dir must be a string"),
    ('kill_wait_s = 1\nsource = "injct"\n', "source must be one of auto, nvml, inject, not 'injct'"),
    ('kill_wait_s = 1\nstrikt = true\n', "unknown key 'strikt' ignored (did you mean 'strict'?)"),
    ("gpus = 2.7\nkill_wait_s = 1\n", "gpus must be a whole number, not 2.7"),
    ('gpus = "4"\nkill_wait_s = 1\n', "gpus must be a whole number, not '4'"),
    ("kill_wait_s = 1\ninject_file = 5\n", "inject_file must be a string, not 5"),
    ("kill_wait_s = [\n", "cannot be read"),
    (b"kill_wait_s = 1\n# \xff\n", "cannot be read"),
])
def test_a_hook_takes_the_default_for_what_it_cannot_read_and_says_so(tmp_path: Path, text: str | bytes,
                                                                      says: str) -> None:
    path = tmp_path / "hooks.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    problems: list[str] = []
    config = load_hook_config(path, problems)
    assert len(problems) == 1 and says in problems[0], problems
    unreadable = says == "cannot be read"
    assert config == (HookConfig() if unreadable else HookConfig(kill_wait_s=1.0))


def test_the_epilog_with_a_broken_config_still_kills_the_jobs_leftovers(tmp_path: Path) -> None:
    """Its clean-up does not depend on the config: a broken one is logged and the defaults taken."""
    (tmp_path / "hooks.toml").write_text(f'kill_wait_s = "soon"\nlog_file = "{tmp_path}/hooks.log"\n')
    leaked = subprocess.Popen(["sleep", "300"], env={**os.environ, "SLURM_JOB_ID": "97731",
                                                     "SLURM_ELASTIC_WORKER_ID": "0001"}, start_new_session=True)
    try:
        env = {**os.environ, "SLURM_JOB_ID": "97731", "SLURMD_NODENAME": "n1", "SLURM_ELASTIC_PYTHON": sys.executable,
               "SLURM_ELASTIC_HOOKS_CONFIG": str(tmp_path / "hooks.toml"), "PYTHONPATH": str(ROOT)}
        result = subprocess.run([str(ROOT / "sbin" / "slurm-elastic-epilog")], env=env, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0
        assert leaked.wait(timeout=10) is not None  # terminated by the epilog
        log = (tmp_path / "hooks.log").read_text()
        assert "kill_wait_s must be a number, not 'soon'" in log and "cleaned job 97731: 1 leftover" in log, log
    finally:
        leaked.kill()
        leaked.wait()


@pytest.mark.parametrize(("text", "says"), [
    ("kill_wait_s = 1e300\n", "kill_wait_s must be at most 3600 (the node stays COMPLETING while the epilog waits)"),
    ("kill_wait_s = inf\n", "kill_wait_s must be a finite number >= 0"),
    ("gpus = 99999999999\n", "gpus must be at most 1024 (GPUs of one node)"),
    ('node_state_dir = "/var/lib/a\\u0000b"\n', "node_state_dir holds a NUL character"),
])
def test_hooks_values_past_their_largest_or_unusable_are_refused(tmp_path: Path, text: str, says: str) -> None:
    """Before, ``kill_wait_s = 1e300`` loaded: the epilog would never send SIGKILL to a process that
    ignores SIGTERM, and the node stayed COMPLETING; ``gpus`` took any count as the drill's fake GPUs."""
    (tmp_path / "hooks.toml").write_text(text)
    with pytest.raises(ValueError, match=re.escape(says)):
        load_hook_config(tmp_path / "hooks.toml")
