"""The policy against its limits, in the simulator: the clairvoyant reference and every fixed count.

Short forms of the example traces the policy was tuned on (1200 s, two seeds, medians); pure and
deterministic (same trace + policy + seed = same run), a few seconds in all.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import pytest

from slurm_elastic.sim.clairvoyant import clairvoyant_schedule
from slurm_elastic.sim.engine import simulate
from slurm_elastic.sim.output import load_trace
from slurm_elastic.sim.trace import Trace

TRACES = Path(__file__).resolve().parents[2] / "examples" / "traces"
SEEDS = (0, 1)


def _short(name: str, duration_s: float = 1200.0) -> Trace:
    return dataclasses.replace(load_trace(TRACES / f"{name}.toml"), duration_s=duration_s)


def _medians(trace: Trace, policy: str) -> tuple[float, float]:
    runs = [simulate(trace, policy, seed).metrics for seed in SEEDS]
    return (statistics.median(r["trainer_idle_fraction"] for r in runs),
            statistics.median(r["gpu_seconds"] for r in runs))


@pytest.mark.parametrize("name", ["steady", "bursty", "phase_shift", "failures"])
def test_no_fixed_count_dominates_ours(name: str) -> None:
    trace = _short(name)
    ours_idle, ours_gpu_s = _medians(trace, "ours")
    top = min(trace.cluster.gpu_slots, trace.autoscaler.max_workers)
    for workers in range(trace.autoscaler.min_workers, top + 1):
        sized = dataclasses.replace(trace, baselines=dataclasses.replace(trace.baselines, static_mid_workers=workers))
        idle, gpu_s = _medians(sized, "static-mid")
        dominated = idle <= ours_idle and gpu_s <= ours_gpu_s and (idle < ours_idle or gpu_s < ours_gpu_s)
        assert not dominated, f"static {workers}: idle {idle:.3f} on {gpu_s:.0f} GPU-s vs ours {ours_idle:.3f} on {ours_gpu_s:.0f}"


def test_the_clairvoyant_schedule_feeds_the_trainer_as_the_maximum_does_on_fewer_gpu_seconds() -> None:
    trace = _short("phase_shift", 600.0)
    schedule, result = clairvoyant_schedule(trace, seed=0, slack_fraction=0.0)
    top = simulate(trace, "static-max", 0).metrics
    assert [t for t, _w in schedule] == [0.0, 120.0, 240.0, 360.0, 480.0]
    assert result.metrics["gpu_seconds"] < 0.8 * top["gpu_seconds"]
    assert result.metrics["trainer_idle_fraction"] <= top["trainer_idle_fraction"] + 0.01
    again = clairvoyant_schedule(trace, seed=0, slack_fraction=0.0)
    assert again[0] == schedule and again[1].metrics == result.metrics  # deterministic


def test_more_slack_buys_fewer_gpu_seconds_with_more_idle() -> None:
    trace = _short("steady", 600.0)
    tight = clairvoyant_schedule(trace, seed=0, slack_fraction=0.0)[1].metrics
    loose = clairvoyant_schedule(trace, seed=0, slack_fraction=0.15)[1].metrics
    assert loose["gpu_seconds"] < tight["gpu_seconds"]
    assert loose["trainer_idle_fraction"] > tight["trainer_idle_fraction"]
