"""bench/bench_sim_fidelity.py's figures: the same arithmetic for the real run's polls and the simulation's ticks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_sim_fidelity_under_test", BENCH / "bench_sim_fidelity.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_figures_integrate_the_count_and_list_target_changes(bench: ModuleType) -> None:
    # 2 workers for 10 s, 6 for 20 s, 5 for 30 s; the target 2 -> 6 at 10 s, 6 -> 5 at 30 s
    out = bench.figures([0.0, 10.0, 30.0], [2.0, 6.0, 5.0], [2, 6, 5], idle_s=6.0, duration_s=60.0,
                        dropped=8.0, max_staleness=2, steps=10)
    assert out["gpu_s"] == pytest.approx(2 * 10 + 6 * 20 + 5 * 30)
    assert out["workers_per_window"] == [4.0, 5.0]  # medians of (2, 6) and (5)
    assert out["changes"] == [(10.0, 2, 6), (30.0, 6, 5)]
    assert (out["ups"], out["downs"], out["first_up_s"]) == (1, 1, 10.0)
    assert out["idle_fraction"] == pytest.approx(0.1)


def test_sim_side_of_a_fidelity_trace(bench: ModuleType) -> None:
    trace = bench.load_trace(BENCH / "fidelity" / "steady_small.toml")
    out = bench.run_sim(trace, 0)
    assert out["max_staleness"] <= trace.queue.max_staleness
    assert out["gpu_s"] == pytest.approx(out["gpu_s_counted"], rel=0.05)  # the tick integral ~ launch-to-exit
    assert out["ups"] >= 1 and len(out["workers_per_window"]) == 12
