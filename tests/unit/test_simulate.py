"""The trace simulator: determinism, conservation, failures, the trace parser, the CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.core.scaling import Decision, PressureInputs
from slurm_elastic.errors import EXIT_CONFIG, ConfigError
from slurm_elastic.sim.engine import Simulation, simulate
from slurm_elastic.sim.output import load_trace
from slurm_elastic.sim.policies import POLICIES, DeoPolicy, ThresholdPolicy
from slurm_elastic.sim.results import ScaleEvent, count_reversals
from slurm_elastic.sim.trace import Failure, Trace, parse_trace

TRACES = Path(__file__).resolve().parents[2] / "examples" / "traces"
SHORT = """
name = "short"
duration_s = 300
[cluster]
gpu_slots = 6
initial_workers = 2
startup_s = 1.0
warmup_s = 5.0
[queue]
batch_size = 32
group_size = 8
capacity_seqs = 128
max_staleness = 1
[trainer]
step_s = 4.0
[rollout]
distribution = "pareto"
median_s = 3.0
alpha = 1.5
[autoscaler]
max_workers = 6
scale_up_cooldown_s = 10
scale_down_cooldown_s = 20
"""


def short(**changes: object) -> Trace:
    return dataclasses.replace(parse_trace(SHORT), **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", POLICIES)
def test_same_seed_same_run(policy: str) -> None:
    assert simulate(short(), policy, 7).summary() == simulate(short(), policy, 7).summary()


@pytest.mark.parametrize("policy", POLICIES)
def test_sequences_are_conserved(policy: str) -> None:
    m = simulate(short(failures=(Failure(at_s=100, workers=2),)), policy, 3).metrics
    assert m["generated_seqs"] == m["consumed_seqs"] + m["dropped_stale_seqs"] + m["buffered_seqs"]
    assert m["consumed_seqs"] - m["trainer_steps"] * 32 in (0, 32)  # a batch may be in training at the end
    assert m["trainer_steps"] > 10
    assert 0.0 <= m["trainer_idle_fraction"] <= 1.0


def test_failed_workers_are_relaunched_after_backoff() -> None:
    sim = Simulation(short(failures=(Failure(at_s=100, workers=2),)), "static-max", 1)
    result = sim.run()
    assert result.metrics["worker_failures"] == 2
    assert result.metrics["launches"] == 6 + 2  # the same two worker ids, launched again
    after = [s for s in result.samples if s.t_s > 150]
    assert all(s.active == 6 for s in after)  # back at full strength


def test_the_controllers_tick_cordons_a_gpu_its_workers_keep_crashing_on() -> None:
    one_gpu = short(cluster=dataclasses.replace(short().cluster, gpu_slots=1, initial_workers=1),
                    failures=tuple(Failure(at_s=t, workers=1) for t in (50, 100, 150)))
    sim = Simulation(one_gpu, "static-max", 1)
    result = sim.run()
    assert result.metrics["worker_failures"] == 3 and result.metrics["launches"] == 3
    assert ("sim", 0) in sim.state.cordons.cordoned()  # three crashes within the window: no relaunch
    assert all(s.active == 0 for s in result.samples if s.t_s > 160)  # its relaunch waits in BACKOFF


def test_static_policy_never_scales_and_start_up_shows_as_starting() -> None:
    result = simulate(short(), "static-mid", 0)
    assert result.metrics["scale_actions"] == 0 and result.metrics["mean_workers"] == pytest.approx(3, abs=0.05)
    assert result.samples[0].active == 3  # registered 1 s after launch, before the first tick (2 s)
    slow = short(cluster=dataclasses.replace(short().cluster, startup_s=3.0))
    assert simulate(slow, "static-mid", 0).samples[0].starting == 3


def test_ours_scales_up_a_starving_trainer_without_reversals() -> None:
    result = simulate(short(), "ours", 0)
    assert result.scale_events and result.scale_events[0].action == "scale_up"
    # the one reversal allowed: the start-up's sizing step sheds what the start-up launched blind
    sizing = [i for i, e in enumerate(result.scale_events) if "start-up ends" in e.reason]
    assert sizing and result.metrics["reversals"] == (1 if sizing[0] == 1 else 0)
    assert count_reversals(result.scale_events[sizing[0]:], 60.0) == 0
    assert all(e.reason for e in result.scale_events)


def test_reversals_count_opposite_actions_within_the_window() -> None:
    def ev(t: float, action: str) -> ScaleEvent:
        return ScaleEvent(t, action, 0, 0, "")

    events = [ev(0, "scale_up"), ev(10, "scale_down"), ev(100, "scale_up"), ev(105, "scale_up")]
    assert count_reversals(events, 60.0) == 1


def test_baselines_directions() -> None:
    cfg = short().autoscaler
    starving = PressureInputs(queued_seqs=0, batch_size=32, workers_active=3, allowed_slots=6)
    full = dataclasses.replace(starving, queued_seqs=128)
    assert DeoPolicy(cfg).decide(starving, 0).action == "scale_up"
    assert DeoPolicy(cfg).decide(full, 0).action == "scale_down"  # the sign DEO had backwards
    threshold = ThresholdPolicy(cfg, interval_s=0)
    first: Decision = threshold.decide(starving, 0)
    assert first.action == "hold" and "not stable" in first.reason  # min_stable_period
    assert threshold.decide(starving, 20).target_workers == 4  # +1, never more


@pytest.mark.parametrize("name", sorted(path.stem for path in TRACES.glob("*.toml")))
def test_example_traces_parse(name: str) -> None:
    trace = parse_trace((TRACES / f"{name}.toml").read_text())
    assert trace.name == name and trace.duration_s > 0


@pytest.mark.parametrize(("text", "message"), [
    ("duration_s = -1", "duration_s: must be a number > 0"),
    ("[cluster]\ngpu_slot = 3", "cluster.gpu_slot: unknown field"),
    ("[queue]\nbatch_size = 1.5", "queue.batch_size: must be an integer"),
    ("[queue]\nbatch_size = 60", r"queue.batch_size \(60\) must be a multiple of queue.group_size \(8\)"),
    ("[rollout]\ndistribution = 'weibull'", "rollout.distribution: one of"),
    ("[trainer]\nstep_s = 0", "trainer.step_s: must be > 0"),
    ("[[failures]]\nat_s = 'soon'", r"failures\[0\].at_s: must be a number"),
    ("[[throttles]]\ngpus = [99]", r"throttles\[0\].gpus: slots are"),
    ("[cluster]\nstartup_s = 90", "cluster.startup_s .* cluster.warmup_s"),
    ("[autoscaler]\nmax_worker = 3", "autoscaler.max_worker: unknown key"),
    ("color = 'red'", "color: unknown field"),
    ("[cluster", "not valid TOML"),
])
def test_trace_errors_name_the_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_trace(text)


def test_cli_writes_summary_and_timeline(tmp_path: Path) -> None:
    trace = tmp_path / "short.toml"
    trace.write_text(SHORT)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["simulate", str(trace), "--out", str(out), "--policy", "threshold",
                                       "--seed", "2"])
    assert result.exit_code == 0, result.output
    assert "trainer idle fraction" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["policy"], summary["seed"]) == ("threshold", 2)
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_reports_a_bad_trace_in_one_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.toml"
    trace.write_text("[queue]\nbatch_size = 0\n")
    result = CliRunner().invoke(main, ["simulate", str(trace), "--out", str(tmp_path), "--no-plot"])
    assert result.exit_code == EXIT_CONFIG and "queue.batch_size: must be > 0" in result.output


def test_start_up_ramp_feeds_the_trainer_sooner_than_one_worker_at_a_time() -> None:
    trace = dataclasses.replace(load_trace(TRACES / "steady.toml"), duration_s=200.0)
    idle_s = trace.duration_s * simulate(trace, "ours", 0).metrics["trainer_idle_fraction"]
    assert idle_s < 70.0  # one worker at a time idled ~100 s of the first 200; static-max ~31 s


def test_the_help_of_an_unbounded_number_shows_no_range() -> None:
    """``--seed`` takes any whole number: its help read ``[x<=None]`` (click's range of no bounds)."""
    out = CliRunner().invoke(main, ["simulate", "--help"]).output
    assert "None" not in out and "--seed INTEGER" in out
