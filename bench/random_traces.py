"""Ours against the fixed counts on randomly drawn traces that no policy was tuned on: how often
some fixed count dominates ours where nobody has looked.

    .venv/bin/python bench/random_traces.py --count 16 --seeds 10 --jobs 2   # ~15 minutes on 2 cores
    .venv/bin/python bench/random_traces.py --count 16 --write DIR           # only write the traces (TOML)
    .venv/bin/python bench/random_traces.py --first 16 --count 8 --code /path/to/another/checkout
    .venv/bin/python bench/random_traces.py --code /tmp/variant --fixed-code /tmp/checkout-of-main

The fixed counts' runs are kept in bench/policy_seeds.py's cache, keyed by the trace's text and a
hash of the code that ran them (``--fixed-code``, default ``--code``): a variant's check then runs
only ours (about 3 minutes for 16 traces at 10 seeds on 2 cores).

Trace i is drawn from seed i, so every machine draws the same ones. Each is drawn from the space
the shipped traces span (docs/autoscaler.md, "Trace fields"): the rollout time's distribution and
median, the group and batch size, the trainer's step, the staleness bound, the model load, GPU
slots 1.6 to 3 times the mean-flow count (4 to 40), one shape (steady, steps in rollout time,
swings, trainer phases, spikes), worker losses and throttled GPUs. For each trace and seed
0..N-1: ours, and the fixed counts that could dominate it (from 0.6x ours' fewest mean workers
to one above its most); one line per trace (ours' medians, on how many seeds a fixed count
dominates ours, which counts dominate at medians and in what share of 400 resamples of the seeds,
bench/policy_seeds.py's ``robustness``), then the totals. Pure simulation.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import random
import sys
import tempfile
from collections.abc import Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.policy_seeds import (
    CACHE,
    Pool,
    Run,
    _digest,
    _dominates,
    _medians,
    code_digest,
    load_cache,
    robustness,
    save_cache,
)

BEYOND_NOISE = 0.95  # a trace dominated at medians in this share of the resamples: beyond the seeds' noise
MEAN_OVER_MEDIAN = {"lognormal": 1.25, "exponential": 1.44, "pareto": 2.0, "fixed": 1.0}  # about, for sizing


def draw_trace(index: int) -> str:
    """Trace ``index`` as TOML (the same text for the same index)."""
    r = random.Random(1000 + index)
    dist = r.choice(["lognormal", "lognormal", "exponential", "pareto", "fixed"])
    median_s, group = r.choice([4, 6, 8, 10, 14, 20, 30]), r.choice([4, 8, 8, 16, 16, 32])
    batch, step_s = group * r.choice([4, 6, 8, 12, 16]), r.choice([6, 8, 10, 15, 20, 30])
    need = batch / step_s / group * median_s * MEAN_OVER_MEDIAN[dist]  # workers at mean flow
    slots = max(4, min(40, int(need * r.uniform(1.6, 3.0)) + 1))
    out = [f'name = "random{index}"', f'description = "drawn by bench/random_traces.py from seed {index}"',
           "duration_s = 1800", f"seed = {r.randint(1, 999)}",
           "[cluster]", f"gpu_slots = {slots}", f"warmup_s = {r.choice([10, 20, 30, 45, 60, 90])}.0",
           "[queue]", f"batch_size = {batch}", f"group_size = {group}", f"capacity_seqs = {max(4 * batch, 256)}",
           f"max_staleness = {r.choice([1, 2, 2, 3, 4, 6])}",
           "[trainer]", f"step_s = {step_s}.0", f"step_jitter = {r.choice([0.0, 0.1, 0.3])}",
           "[rollout]", f'distribution = "{dist}"', f"median_s = {median_s}.0", "max_s = 400.0"]
    if dist == "lognormal":
        out.append(f"sigma = {r.choice([0.3, 0.6, 0.9, 1.1])}")
    elif dist == "pareto":
        out.append(f"alpha = {r.choice([1.5, 2.0, 2.5])}")
    out += ["[autoscaler]", f"max_workers = {slots}", "[[phases]]", "start_s = 0"]
    shape = r.choice(["steady", "steps", "swings", "trainer", "spikes"])
    if shape == "steps":
        for k in range(1, r.randint(2, 5)):
            out += ["[[phases]]", f"start_s = {k * 360}", f"rollout_scale = {r.uniform(0.5, 2.0):.2f}"]
    elif shape == "swings":
        period_s, low, high = r.choice([200, 300, 450]), r.uniform(0.5, 0.8), r.uniform(1.2, 2.0)
        for k, start_s in enumerate(range(period_s, 1800, period_s)):
            out += ["[[phases]]", f"start_s = {start_s}", f"rollout_scale = {high if k % 2 == 0 else low:.2f}"]
    elif shape == "trainer":
        for k in range(1, r.randint(2, 4)):
            out += ["[[phases]]", f"start_s = {k * 500}", f"trainer_scale = {r.uniform(0.6, 1.6):.2f}"]
    elif shape == "spikes":
        for start_s in sorted(r.sample(range(200, 1700, 50), 4)):
            out += ["[[phases]]", f"start_s = {start_s}", f"rollout_scale = {r.uniform(1.5, 3.0):.2f}",
                    "[[phases]]", f"start_s = {start_s + r.choice([40, 60, 90])}", "rollout_scale = 1.0"]
    for _ in range(r.choice([0, 0, 1, 2, 3])):
        out += ["[[failures]]", f"at_s = {r.randint(100, 1700)}", f"workers = {r.randint(1, 2)}"]
    if r.random() < 0.3:
        out += ["[[throttles]]", f"start_s = {r.randint(100, 1200)}", f"duration_s = {r.choice([120, 300, 600])}",
                f"slowdown = {r.choice([1.5, 2.0, 3.0])}", f"gpus = {sorted(r.sample(range(slots), min(slots, 3)))}"]
    return f"# shape: {shape}\n" + "\n".join(out) + "\n"


def _run(code: str, path: str, policy: str, seed: int, workers: int) -> Run:
    """One simulation of the trace at ``path``: ``workers`` is the fixed count (static-mid) or unused."""
    if sys.path[0] != code:
        sys.path.insert(0, code)
    from slurm_elastic.sim.engine import simulate
    from slurm_elastic.sim.output import load_trace

    trace = load_trace(Path(path))
    if policy == "static-mid":
        trace = dataclasses.replace(trace, baselines=dataclasses.replace(trace.baselines, static_mid_workers=workers))
    metrics = simulate(trace, policy, seed).metrics
    return metrics["trainer_idle_fraction"], metrics["gpu_seconds"]


def verdict(code: str, fixed_code: str, path: Path, seeds: int, pools: Mapping[str, Pool],
            cache: dict[str, Run]) -> tuple[str, int, bool, float]:
    """One trace's line, the seeds on which a fixed count dominates ours, whether one does at medians,
    and the share of resamples of the seeds in which one does; the fixed counts from ``cache`` where
    there, added to it where not."""
    def runs(code: str, policy: str, tasks: list[tuple[int, int]]) -> list[Run]:
        if not tasks:
            return []
        return list(pools[code].map(_run, *zip(*[(code, str(path), policy, s, n) for s, n in tasks], strict=True)))

    ours = runs(code, "ours", [(s, 0) for s in range(seeds)])
    duration_s = 1800.0
    counts = range(max(1, int(0.6 * min(o[1] for o in ours) / duration_s)), math.ceil(max(o[1] for o in ours) / duration_s) + 2)
    key = f"{code_digest(fixed_code)}:{_digest(path.read_bytes())}"
    missing = [(s, n) for n in counts for s in range(seeds) if f"{key}:{s}:{n}" not in cache]
    for (s, n), run in zip(missing, runs(fixed_code, "static-mid", missing), strict=True):
        cache[f"{key}:{s}:{n}"] = run
    fixed = {n: [cache[f"{key}:{s}:{n}"] for s in range(seeds)] for n in counts}
    by_seed = sum(any(_dominates(fixed[n][s], ours[s]) for n in counts) for s in range(seeds))
    mine = _medians(ours)
    over = [f"static {n} ({m[0]:.3f} / {m[1]:,.0f})" for n in counts if _dominates(m := _medians(fixed[n]), mine)]
    robust = robustness(ours, fixed)
    shape = path.read_text().splitlines()[0].removeprefix("# shape: ")
    line = (f"{path.stem} ({shape}): ours {mine[0]:.3f} idle / {mine[1]:,.0f} GPU-s (medians); a fixed count "
            f"dominates it on {by_seed} of {seeds} seeds; {robust.words()}; at medians "
            f"{'dominated by ' + ', '.join(over) if over else 'not dominated'}")
    return line, by_seed, bool(over), robust.dominated_share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", type=int, default=0, help="the first trace's index (default 0)")
    parser.add_argument("--count", type=int, default=16, help="traces drawn (default 16)")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=1, help="processes")
    parser.add_argument("--code", default=str(Path(__file__).resolve().parents[1]),
                        help="the checkout whose slurm_elastic/ is simulated (default: this one)")
    parser.add_argument("--fixed-code", default=None,
                        help="the checkout whose code simulates the fixed counts (default: --code)")
    parser.add_argument("--cache", type=Path, default=CACHE, help=f"the fixed counts' results (default: {CACHE})")
    parser.add_argument("--write", type=Path, default=None, help="write the traces into this directory, run none")
    args = parser.parse_args()
    indexes = range(args.first, args.first + args.count)
    if args.write is not None:
        args.write.mkdir(parents=True, exist_ok=True)
        for i in indexes:
            (args.write / f"random{i}.toml").write_text(draw_trace(i))
        return
    code = str(Path(args.code).resolve())
    fixed_code = str(Path(args.fixed_code or args.code).resolve())
    for line in verdicts(indexes, args.seeds, args.jobs, code, fixed_code, args.cache):
        print(line, flush=True)


def verdicts(indexes: range, seeds: int, jobs: int, code: str, fixed_code: str, cache_path: Path = CACHE) -> Iterator[str]:
    """One line per trace as it is judged, then the totals (the fixed counts' runs kept at ``cache_path``)."""
    cache = load_cache(cache_path)
    seeds_dominated = traces_dominated = beyond_noise = 0
    # a pool per checkout, spawned: a process imports slurm_elastic once, from the checkout of its pool
    spawn = multiprocessing.get_context("spawn")
    pools = {c: ProcessPoolExecutor(jobs, mp_context=spawn) for c in {code, fixed_code}}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in indexes:
                path = Path(tmp) / f"random{i}.toml"
                path.write_text(draw_trace(i))
                line, by_seed, at_medians, share = verdict(code, fixed_code, path, seeds, pools, cache)
                save_cache(cache_path, cache)
                seeds_dominated, traces_dominated = seeds_dominated + by_seed, traces_dominated + at_medians
                beyond_noise += share >= BEYOND_NOISE
                yield line
    finally:
        for pool in pools.values():
            pool.shutdown()
    yield (f"{traces_dominated} of {len(indexes)} traces dominated at medians, {beyond_noise} of them in "
           f"{BEYOND_NOISE:.0%} or more of the resamples of the seeds; {seeds_dominated} of "
           f"{len(indexes) * seeds} seeds dominated seed by seed")

if __name__ == "__main__":
    main()
