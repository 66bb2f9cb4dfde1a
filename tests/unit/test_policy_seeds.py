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
