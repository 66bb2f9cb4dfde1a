"""Ours against every fixed count, seed by seed: how often a fixed count dominates ours on the same
seed, and how far ours lies above the fixed counts' curve.

    .venv/bin/python bench/policy_seeds.py eval_pauses,long_warmup [--seeds 20] [--jobs 2]
    .venv/bin/python bench/policy_seeds.py all --code /path/to/an/older/checkout   # its policy
    .venv/bin/python bench/policy_seeds.py long_warmup --initial-workers 8          # another start
    .venv/bin/python bench/policy_seeds.py all --code /tmp/variant --fixed-code .   # a variant of ours

For each trace and seed 0..N-1: ours, and every fixed count from min_workers to the top. A fixed
count dominates ours on a seed when it idles no more on no more GPU-seconds, one strictly. The
distance is ours' idle fraction minus the fixed counts' curve (straight between counts) at ours'
GPU-seconds, averaged over the seeds where ours lies inside the curve's range: below 0, ours
idles less than running a mix of fixed counts with its GPU-seconds. Both verdicts are redone on
400 resamples of the seeds (with replacement, the same seeds for every policy): the share of them
in which a fixed count's medians dominate ours' tells a verdict beyond the seeds' noise (near
100 %) from a coin flip (near 50 %), and the distance gets a 95 % interval. ``--code`` simulates the
``slurm_elastic/`` of another checkout on this checkout's traces (the figures "earlier policy →
now" in docs/autoscaler.md). Prints one line per trace, naming the fixed counts whose medians
dominate ours' medians, with theirs; pure simulation, ``--jobs`` processes.

The fixed counts are most of the work (every count, every seed) and do not run through the
autoscaler, so they are kept in ``--cache`` (a JSON file), keyed by a hash of the trace's text and
of every source file of the checkout that simulated them. A variant of the policy, an ad-hoc copy
of the code given as ``--code``, can take its fixed counts from the checkout it was copied from
with ``--fixed-code``: every trace at 20 seeds then takes a minute or two on 2 cores once
that checkout's fixed counts are cached (about half an hour the first time).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import itertools
import json
import multiprocessing
import random
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Protocol

TRACES = Path(__file__).resolve().parent.parent / "examples" / "traces"
CACHE = Path.home() / ".cache" / "slurm-elastic" / "policy_seeds.json"
Run = tuple[float, float]  # (trainer idle fraction, GPU-seconds)


class Pool(Protocol):
    """What runs the simulations: a process pool (or, in a test, anything with its ``map``)."""

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any]) -> Iterator[Any]: ...


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


RESAMPLES = 400  # resamples of the seeds behind each verdict's share and interval


@dataclasses.dataclass(frozen=True)
class Robustness:
    """How far the seeds' noise carries a trace's verdict: ``dominated_share`` of resamples of the
    seeds (drawn with replacement, the same seeds for ours and every fixed count) in which a fixed
    count's medians dominate ours' medians (near 1: beyond the noise; near 0.5: a coin flip), and
    the mean distance above the fixed counts' curve with its 95 % interval over the same resamples."""

    dominated_share: float
    gap: float | None
    gap_low: float | None
    gap_high: float | None

    def words(self) -> str:
        interval = "" if self.gap_low is None else f" (95 % interval {self.gap_low:+.4f} to {self.gap_high:+.4f})"
        gap = "-" if self.gap is None else f"{self.gap:+.4f}"
        return (f"above the fixed counts' curve by {gap} idle (mean over seeds){interval}; dominated at medians in "
                f"{self.dominated_share:.0%} of {RESAMPLES} resamples of the seeds")


def robustness(ours: Sequence[Run], fixed: Mapping[int, Sequence[Run]], resamples: int = RESAMPLES) -> Robustness:
    """The verdict of ``ours`` (a run per seed) against ``fixed`` (count -> a run per seed) under
    resampling of the seeds; the same draws every call (a fixed generator seed)."""
    seeds = len(ours)
    gaps: list[float | None] = [None if (at := _curve_at([runs[s] for runs in fixed.values()], ours[s][1])) is None
                                else ours[s][0] - at for s in range(seeds)]
    rng = random.Random(0)
    dominated, means = 0, []
    for _ in range(resamples):
        picks = [rng.randrange(seeds) for _ in range(seeds)]
        mine = _medians([ours[s] for s in picks])
        dominated += any(_dominates(_medians([runs[s] for s in picks]), mine) for runs in fixed.values())
        if inside := [g for s in picks if (g := gaps[s]) is not None]:
            means.append(statistics.mean(inside))
    known = [g for g in gaps if g is not None]
    if not known or not means:
        return Robustness(dominated / resamples, statistics.mean(known) if known else None, None, None)
    means.sort()
    return Robustness(dominated / resamples, statistics.mean(known), means[int(0.025 * len(means))],
                      means[min(len(means) - 1, int(0.975 * len(means)))])


def _digest(*parts: bytes) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(hashlib.sha256(part).digest())
    return hasher.hexdigest()[:16]


@functools.cache
def code_digest(code: str) -> str:
    """A hash of every source file of ``code``'s ``slurm_elastic/``, names included (once per run)."""
    files = sorted((Path(code) / "slurm_elastic").rglob("*.py"))
    return _digest(*(str(f.relative_to(code)).encode() + b"\0" + f.read_bytes() for f in files))


def _counts(name: str) -> range:
    """Every fixed count of the trace, from min_workers to the top, read without importing the code
    (the defaults are AutoscalerConfig's; tests/unit/test_policy_seeds.py holds them to the loader)."""
    import tomllib

    doc = tomllib.loads((TRACES / f"{name}.toml").read_text())
    scaler = doc.get("autoscaler", {})
    top = min(doc["cluster"]["gpu_slots"], scaler.get("max_workers", 64))
    return range(scaler.get("min_workers", 1), top + 1)


def report(code: str, fixed_code: str, name: str, seeds: int, pools: Mapping[str, Pool],
           initial_workers: int, cache: dict[str, Run]) -> str:
    """One trace's line; the fixed counts from ``cache`` where there, added to it where not."""
    counts = _counts(name)
    key = f"{code_digest(fixed_code)}:{_digest((TRACES / f'{name}.toml').read_bytes())}"
    missing = [(fixed_code, name, "static-mid", s, n) for n in counts for s in range(seeds)
               if f"{key}:{s}:{n}" not in cache]
    ours = list(pools[code].map(_run, *zip(*[(code, name, "ours", s, initial_workers) for s in range(seeds)],
                                           strict=True)))
    if missing:
        for task, run in zip(missing, pools[fixed_code].map(_run, *zip(*missing, strict=True)), strict=True):
            cache[f"{key}:{task[3]}:{task[4]}"] = run
    fixed = [cache[f"{key}:{s}:{n}"] for n in counts for s in range(seeds)]
    by_seed = [[fixed[i * seeds + s] for i in range(len(counts))] for s in range(seeds)]
    dominated = sum(any(_dominates(f, ours[s]) for f in by_seed[s]) for s in range(seeds))
    mine = _medians(ours)
    over = [f"static {n} ({m[0]:.3f} / {m[1]:,.0f})" for i, n in enumerate(counts)
            if _dominates(m := _medians(fixed[i * seeds:(i + 1) * seeds]), mine)]
    robust = robustness(ours, {n: fixed[i * seeds:(i + 1) * seeds] for i, n in enumerate(counts)})
    return (f"{name}: ours {mine[0]:.3f} idle / {mine[1]:,.0f} GPU-s (medians); a fixed count dominates it on "
            f"{dominated} of {seeds} seeds; {robust.words()}; "
            f"at medians {'dominated by ' + ', '.join(over) if over else 'not dominated'}")


def load_cache(path: Path) -> dict[str, Run]:
    """The fixed counts' runs kept at ``path``; none when it is missing or unreadable (they are run anew)."""
    try:
        return {k: (v[0], v[1]) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        return {}


def save_cache(path: Path, cache: dict[str, Run]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache))


def _medians(runs: list[Run]) -> Run:
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", help="comma-separated trace names in examples/traces, or 'all'")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=1, help="processes")
    parser.add_argument("--code", default=str(Path(__file__).resolve().parents[1]),
                        help="the checkout whose slurm_elastic/ is simulated (default: this one)")
    parser.add_argument("--fixed-code", default=None,
                        help="the checkout whose code simulates the fixed counts (default: --code)")
    parser.add_argument("--initial-workers", type=int, default=0, help="ours' workers at t = 0 (0: the trace's)")
    parser.add_argument("--cache", type=Path, default=CACHE, help=f"the fixed counts' results (default: {CACHE})")
    args = parser.parse_args()
    names = sorted(p.stem for p in TRACES.glob("*.toml")) if args.traces == "all" else args.traces.split(",")
    code = str(Path(args.code).resolve())
    fixed_code = str(Path(args.fixed_code).resolve()) if args.fixed_code else code
    cache = load_cache(args.cache)
    # a pool per checkout, spawned: a process imports slurm_elastic once, from the checkout of its pool
    spawn = multiprocessing.get_context("spawn")
    pools = {c: ProcessPoolExecutor(args.jobs, mp_context=spawn) for c in {code, fixed_code}}
    try:
        for name in names:
            print(report(code, fixed_code, name, args.seeds, pools, args.initial_workers, cache), flush=True)
            save_cache(args.cache, cache)
    finally:
        for pool in pools.values():
            pool.shutdown()


if __name__ == "__main__":
    main()
