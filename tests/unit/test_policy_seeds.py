"""bench/policy_seeds.py keeps the fixed counts' runs, keyed by the trace and the code that ran them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import policy_seeds
from slurm_elastic.sim.output import load_trace


class RecordingPool:
    """Stands in for a process pool and records the tasks. Ours idles 0.06 on 14,500 GPU-seconds;
    a fixed count n idles 0.4 / n on 1,600·n: 7, 8 and 9 workers dominate ours."""

    def __init__(self) -> None:
        self.tasks: list[tuple[Any, ...]] = []

    def map(self, fn: Callable[..., Any], *columns: Iterable[Any]) -> Iterator[tuple[float, float]]:
        rows = list(zip(*columns, strict=True))
        self.tasks += rows
        return iter([(0.06, 14_500.0) if policy == "ours" else (0.4 / n, 1_600.0 * n)
                     for _c, _t, policy, _s, n in rows])


def _checkout(root: Path, text: str) -> str:
    (root / "slurm_elastic" / "core").mkdir(parents=True)
    (root / "slurm_elastic" / "core" / "scaling.py").write_text(text)
    return str(root)


def test_the_code_digest_follows_every_source_file(tmp_path: Path) -> None:
    one, same, other = (_checkout(tmp_path / n, t) for n, t in (("a", "x = 1\n"), ("b", "x = 1\n"), ("c", "x = 2\n")))
    assert policy_seeds.code_digest(one) == policy_seeds.code_digest(same) != policy_seeds.code_digest(other)


def test_fixed_counts_are_simulated_once_per_code_and_trace(tmp_path: Path) -> None:
    code, variant = _checkout(tmp_path / "main", "x = 1\n"), _checkout(tmp_path / "variant", "x = 2\n")
    counts = policy_seeds._counts("steady")
    cache: dict[str, tuple[float, float]] = {}
    fixed, ours = RecordingPool(), RecordingPool()

    line = policy_seeds.report(code, code, "steady", 2, {code: fixed}, 0, cache)
    assert len(fixed.tasks) == 2 + 2 * len(counts) and len(cache) == 2 * len(counts)
    assert "dominates it on 2 of 2 seeds" in line and line.endswith(
        "at medians dominated by static 7 (0.057 / 11,200), static 8 (0.050 / 12,800), static 9 (0.044 / 14,400)")

    fixed.tasks.clear()
    policy_seeds.report(variant, code, "steady", 2, {variant: ours, code: fixed}, 0, cache)
    assert fixed.tasks == [] and [t[2] for t in ours.tasks] == ["ours", "ours"]  # the fixed counts: cached

    policy_seeds.report(variant, variant, "steady", 2, {variant: ours}, 0, cache)
    assert len(cache) == 4 * len(counts)  # another code: its own fixed counts


@pytest.mark.parametrize("name", sorted(p.stem for p in policy_seeds.TRACES.glob("*.toml")))
def test_the_fixed_counts_read_from_the_toml_are_the_loaders(name: str) -> None:
    trace = load_trace(policy_seeds.TRACES / f"{name}.toml")
    top = min(trace.cluster.gpu_slots, trace.autoscaler.max_workers)
    assert policy_seeds._counts(name) == range(trace.autoscaler.min_workers, top + 1)


def test_a_fixed_count_better_on_every_seed_dominates_beyond_the_noise() -> None:
    ours = [(0.10 + 0.01 * s, 10_000.0) for s in range(10)]
    fixed = {4: [(0.30, 8_000.0)] * 10, 5: [(0.05 + 0.01 * s, 9_900.0) for s in range(10)],
             6: [(0.02, 12_000.0)] * 10}
    robust = policy_seeds.robustness(ours, fixed)
    assert robust.dominated_share == 1.0
    assert robust.gap is not None and robust.gap_low is not None and robust.gap_high is not None
    assert 0 < robust.gap_low <= robust.gap <= robust.gap_high
    assert "dominated at medians in 100% of 400 resamples" in robust.words()


def test_a_verdict_the_seeds_split_is_a_coin_flip() -> None:
    """Static 5 beats ours on half the seeds and loses on the other half by as much: at medians a
    tie either way, so the resamples split."""
    ours = [(0.10, 10_000.0)] * 10
    fixed = {5: [(0.09 if s % 2 else 0.11, 9_900.0) for s in range(10)], 8: [(0.01, 16_000.0)] * 10}
    robust = policy_seeds.robustness(ours, fixed)
    assert 0.2 < robust.dominated_share < 0.8
    assert robust.gap_low is not None and robust.gap_high is not None and robust.gap_low < 0 < robust.gap_high


def test_ours_outside_the_curve_has_no_distance() -> None:
    robust = policy_seeds.robustness([(0.1, 50_000.0)] * 4, {4: [(0.2, 8_000.0)] * 4, 5: [(0.1, 10_000.0)] * 4})
    assert robust.gap is None and robust.dominated_share == 1.0
    assert robust.words().startswith("above the fixed counts' curve by - idle")
