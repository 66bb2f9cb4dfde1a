"""Helpers shared by the benchmarks: statistics and report writing."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

OUT_DIR = Path(__file__).parent / "out"


def percentile(values: list[float], pct: float) -> float:
    """The ``pct`` percentile (nearest rank) of ``values``."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1))))
    return ordered[rank]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def write_report(name: str, markdown: str) -> Path:
    """Write ``bench/out/<name>.md`` and print it."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.md"
    path.write_text(markdown)
    print(markdown)
    return path


def write_headline(name: str, rows: list[tuple[str, str, str, str]]) -> Path:
    """Write ``bench/out/<name>.headline.json``: the figures ``bench/run_all.py`` puts in its summary.

    Each row is (figure, ours, baseline measured in the same run, ratio or verdict)."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.headline.json"
    path.write_text(json.dumps([{"figure": f, "ours": o, "baseline": b, "ratio": r} for f, o, b, r in rows],
                               indent=1))
    return path
