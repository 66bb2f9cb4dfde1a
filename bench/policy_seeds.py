"""Ours against every fixed count, seed by seed: how often a fixed count dominates ours on the same
seed, and how far ours lies above the fixed counts' curve.

    .venv/bin/python bench/policy_seeds.py eval_pauses,long_warmup [--seeds 20] [--jobs 2]
    .venv/bin/python bench/policy_seeds.py all --code /path/to/an/older/checkout   # its policy
    .venv/bin/python bench/policy_seeds.py long_warmup --initial-workers 8          # another start

For each trace and seed 0..N-1: ours, and every fixed count from min_workers to the top. A fixed
count dominates ours on a seed when it idles no more on no more GPU-seconds, one strictly. The
distance is ours' idle fraction minus the fixed counts' curve (straight between counts) at ours'
GPU-seconds, averaged over the seeds where ours lies inside the curve's range: below 0, ours
idles less than running a mix of fixed counts with its GPU-seconds. ``--code`` simulates the
``slurm_elastic/`` of another checkout on this checkout's traces (the figures "earlier policy →
now" in docs/autoscaler.md). Prints one line per trace, naming the fixed counts whose medians
dominate ours' medians, with theirs; pure simulation, ``--jobs`` processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

TRACES = Path(__file__).resolve().parent.parent / "examples" / "traces"
Run = tuple[float, float]  # (trainer idle fraction, GPU-seconds)


def _use_code(code: str) -> None:
    """Import ``slurm_elastic`` from ``code`` (once per process)."""
    if sys.path[0] != code:
        sys.path.insert(0, code)


def _run(code: str, name: str, policy: str, seed: int, workers: int) -> Run:
    """One simulation: ``workers`` is the fixed count (static) or the initial count (ours; 0: the trace's)."""
    _use_code(code)
    from slurm_elastic.sim.engine import simulate
    from slurm_elastic.sim.output import load_trace

    trace = load_trace(TRACES / f"{name}.toml")
    if policy == "static-mid":
        trace = dataclasses.replace(trace, baselines=dataclasses.replace(trace.baselines, static_mid_workers=workers))
    elif workers:
        trace = dataclasses.replace(trace, cluster=dataclasses.replace(trace.cluster, initial_workers=workers))
    metrics = simulate(trace, policy, seed).metrics
    return metrics["trainer_idle_fraction"], metrics["gpu_seconds"]


def _curve_at(points: list[Run], gpu_s: float) -> float | None:
    """The fixed counts' idle at ``gpu_s``, straight between neighbouring counts; None outside them."""
    ordered = sorted(points, key=lambda p: p[1])
    for (idle0, gpu0), (idle1, gpu1) in itertools.pairwise(ordered):
        if gpu0 <= gpu_s <= gpu1:
            return idle0 + (idle1 - idle0) * (gpu_s - gpu0) / (gpu1 - gpu0)
    return None


def _dominates(fixed: Run, ours: Run) -> bool:
    return fixed[0] <= ours[0] and fixed[1] <= ours[1] and (fixed[0] < ours[0] or fixed[1] < ours[1])


def report(code: str, name: str, seeds: int, jobs: int, initial_workers: int) -> str:
    _use_code(code)
    from slurm_elastic.sim.output import load_trace

    trace = load_trace(TRACES / f"{name}.toml")
    counts = range(trace.autoscaler.min_workers, min(trace.cluster.gpu_slots, trace.autoscaler.max_workers) + 1)
    tasks = [(code, name, "ours", s, initial_workers) for s in range(seeds)]
    tasks += [(code, name, "static-mid", s, n) for n in counts for s in range(seeds)]
    with ProcessPoolExecutor(jobs) as pool:
        runs = list(pool.map(_run, *zip(*tasks, strict=True)))
    ours, fixed = runs[:seeds], runs[seeds:]
    by_seed = [[fixed[i * seeds + s] for i in range(len(counts))] for s in range(seeds)]
    dominated = sum(any(_dominates(f, ours[s]) for f in by_seed[s]) for s in range(seeds))
    gaps = [ours[s][0] - at for s in range(seeds) if (at := _curve_at(by_seed[s], ours[s][1])) is not None]
    gap = f"{statistics.mean(gaps):+.4f}" if gaps else "-"
    mine = _medians(ours)
    over = [f"static {n} ({m[0]:.3f} / {m[1]:,.0f})" for i, n in enumerate(counts)
            if _dominates(m := _medians(fixed[i * seeds:(i + 1) * seeds]), mine)]
    return (f"{name}: ours {mine[0]:.3f} idle / {mine[1]:,.0f} GPU-s (medians); a fixed count dominates it on "
            f"{dominated} of {seeds} seeds; above the fixed counts' curve by {gap} idle (mean over seeds); "
            f"at medians {'dominated by ' + ', '.join(over) if over else 'not dominated'}")


def _medians(runs: list[Run]) -> Run:
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", help="comma-separated trace names in examples/traces, or 'all'")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=1, help="processes")
    parser.add_argument("--code", default=str(Path(__file__).resolve().parents[1]),
                        help="the checkout whose slurm_elastic/ is simulated (default: this one)")
    parser.add_argument("--initial-workers", type=int, default=0, help="ours' workers at t = 0 (0: the trace's)")
    args = parser.parse_args()
    names = sorted(p.stem for p in TRACES.glob("*.toml")) if args.traces == "all" else args.traces.split(",")
    for name in names:
        print(report(str(Path(args.code).resolve()), name, args.seeds, args.jobs, args.initial_workers), flush=True)


if __name__ == "__main__":
    main()
