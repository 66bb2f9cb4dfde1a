"""Policy benchmark: every policy, every fixed count and the clairvoyant reference on every example
trace, several seeds, medians, each policy's distance to the limit.

    .venv/bin/python bench/bench_policy.py --quick      # 2 seeds, 3 clairvoyant slacks, verdicts over 5 seeds
    .venv/bin/python bench/bench_policy.py [--seeds 5]  # 5 clairvoyant slacks, verdicts over 20 seeds
    .venv/bin/python bench/bench_policy.py --jobs 2     # the same figures, two traces at once
    .venv/bin/python bench/bench_policy.py --random 16  # and ours against the fixed counts on 16 random traces

Writes bench/out/policy.md. Pure simulation (slurm_elastic.sim): no cluster, one core per job.
Metrics and the clairvoyant search are defined in docs/autoscaler.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import median, write_headline, write_report
from slurm_elastic.sim.clairvoyant import clairvoyant_schedule
from slurm_elastic.sim.engine import simulate
from slurm_elastic.sim.output import load_trace
from slurm_elastic.sim.policies import POLICIES
from slurm_elastic.sim.trace import Trace

TRACES = Path(__file__).resolve().parent.parent / "examples" / "traces"
RANDOM_SEEDS = 10
TRACE_NAMES = ("steady", "bursty", "phase_shift", "failures", "eval_pauses", "long_warmup", "checkpoint_stalls",
               "big_batch_pareto", "fixed_rollouts_faster_trainer", "irregular_pauses",
               # written held out; tuning traces since the setpoint's floor was chosen on them too
               "ramp", "speedup_bursts", "sine_trainer", "shrinking_episodes", "wide_groups_exponential",
               "many_slots_concise", "drifting_rollouts", "agentic_long_tail", "concise_then_verbose",
               "mixed_fleet",  # written held out; tuning since the drain order looks at a worker's speed
               "alternating_tasks", "brief_spikes")  # written held out; tuning since the swing rule
HELD_OUT = ("rolling_throttles",  # written after the policy was tuned
            "growing_context", "worker_churn", "slow_tides",
            "slow_node_pareto", "staircase_down", "midrun_heat",
            "node_loss_long_load", "trainer_sprints", "onpolicy_heavy_tail",
            "legacy_first", "lognormal_big_batch")
METRICS = ("trainer_idle_fraction", "gpu_seconds", "max_staleness", "scale_actions", "reversals")
SLACKS_FULL = (0.0, 0.02, 0.05, 0.1, 0.2)
SLACKS_QUICK = (0.0, 0.05, 0.15)
Point = dict[str, float]


def _medians(runs: list[dict[str, float]]) -> Point:
    return {k: median([r[k] for r in runs]) for k in (*METRICS, "mean_workers")}


def _static_run(trace: Trace, workers: int, seed: int) -> dict[str, float]:
    key = (trace.name, workers, seed)
    if key not in _STATIC_RUNS:
        sized = dataclasses.replace(trace, baselines=dataclasses.replace(trace.baselines, static_mid_workers=workers))
        _STATIC_RUNS[key] = simulate(sized, "static-mid", seed).metrics
    return _STATIC_RUNS[key]


_STATIC_RUNS: dict[tuple[str, int, int], dict[str, float]] = {}


def static_count(trace: Trace, workers: int, seeds: int) -> Point:
    """A fixed count (the static-mid policy at ``workers``), medians over the seeds."""
    return _medians([_static_run(trace, workers, seed) for seed in range(seeds)])


def verdict(trace: Trace, seeds: int) -> tuple[list[int], int]:
    """Over seeds 0..``seeds``-1: the fixed counts whose medians dominate ours' medians, and on how
    many seeds some fixed count dominates ours on that seed (the same seed for both)."""
    counts = range(trace.autoscaler.min_workers, min(trace.cluster.gpu_slots, trace.autoscaler.max_workers) + 1)
    ours = [simulate(trace, "ours", seed).metrics for seed in range(seeds)]
    by_seed = sum(1 for seed, mine in enumerate(ours)
                  if any(dominates(_static_run(trace, n, seed), mine) for n in counts))
    mine = _medians(ours)
    return [n for n in counts if dominates(static_count(trace, n, seeds), mine)], by_seed


def dominates(a: Point, b: Point) -> bool:
    """``a`` idles no more on no more GPU-seconds than ``b``, and is strictly better in one."""
    idle_a, idle_b, gpu_a, gpu_b = (a["trainer_idle_fraction"], b["trainer_idle_fraction"],
                                    a["gpu_seconds"], b["gpu_seconds"])
    return idle_a <= idle_b and gpu_a <= gpu_b and (idle_a < idle_b or gpu_a < gpu_b)


def frontier(points: list[Point]) -> list[tuple[float, float]]:
    """The lower-left frontier of ``points`` as (GPU-s, idle), GPU-s rising, idle falling."""
    ordered = sorted((p["gpu_seconds"], p["trainer_idle_fraction"]) for p in points)
    front: list[tuple[float, float]] = []
    for gpu, idle in ordered:
        if not front or idle < front[-1][1]:
            front.append((gpu, idle))
    return front


def distances(p: Point, front: list[tuple[float, float]]) -> tuple[float | None, float | None]:
    """(extra GPU-seconds over the limit at ``p``'s idle, extra idle fraction over the limit at
    ``p``'s GPU-seconds); the limit is piecewise linear between frontier points (running one
    schedule part of the time and the next the rest gives about their average); None: outside it."""
    idle, gpu = p["trainer_idle_fraction"], p["gpu_seconds"]
    extra_gpu = extra_idle = None
    for (g0, i0), (g1, i1) in itertools.pairwise(front):
        if i1 <= idle <= i0:
            extra_gpu = gpu - (g0 + (g1 - g0) * (i0 - idle) / (i0 - i1))
        if g0 <= gpu <= g1:
            extra_idle = idle - (i0 + (i1 - i0) * (gpu - g0) / (g1 - g0))
    if front and gpu >= front[-1][0]:
        extra_idle = idle - front[-1][1]
    return extra_gpu, extra_idle


def _fmt_gpu(extra: float | None, gpu: float) -> str:
    return "-" if extra is None else f"{extra:+.0f} ({extra / gpu:+.0%})"


def _fmt_idle(extra: float | None) -> str:
    return "-" if extra is None else f"{extra:+.3f}"


def trace_section(name: str, seeds: int, slacks: tuple[float, ...], verdict_seeds: int
                  ) -> tuple[list[str], str, tuple[str, str, str, str]]:
    """One trace: its table's lines, its verdict line and its headline row."""
    trace = load_trace(TRACES / f"{name}.toml")
    med: dict[str, Point] = {}
    for policy in POLICIES:
        med[policy] = _medians([simulate(trace, policy, seed).metrics for seed in range(seeds)])
    for slack in slacks:
        med[f"clairvoyant (slack {slack:g})"] = _medians(
            [clairvoyant_schedule(trace, seed, slack_fraction=slack)[1].metrics for seed in range(seeds)])
    top = min(trace.cluster.gpu_slots, trace.autoscaler.max_workers)
    statics = {n: static_count(trace, n, seeds) for n in range(trace.autoscaler.min_workers, top + 1)}
    for n, point in statics.items():
        med[f"static-{n}"] = point
    limit = frontier([p for k, p in med.items() if k.startswith(("clairvoyant", "static-"))])
    ours = med["ours"]
    held = " (held out from tuning)" if name in HELD_OUT else ""
    lines = [f"## {name}{held}: {trace.description}", "",
             "| policy | trainer idle | GPU-s | mean workers | max staleness | scale actions | reversals "
             "| extra GPU-s vs limit | extra idle vs limit |",
             "|---|---|---|---|---|---|---|---|---|"]
    for policy, m in med.items():
        extra_gpu, extra_idle = distances(m, limit)
        label = f"**{policy}**" if policy == "ours" else policy
        lines.append(f"| {label} | {m['trainer_idle_fraction']:.3f} | {m['gpu_seconds']:.0f} | "
                     f"{m['mean_workers']:.2f} | {m['max_staleness']:.0f} | {m['scale_actions']:.0f} | "
                     f"{m['reversals']:.0f} | {_fmt_gpu(extra_gpu, m['gpu_seconds'])} | {_fmt_idle(extra_idle)} |")
    lines.append("")
    cheaper = [p for p in POLICIES if p != "ours" and med[p]["gpu_seconds"] <= ours["gpu_seconds"]]
    best = all(med[p]["trainer_idle_fraction"] > ours["trainer_idle_fraction"] for p in cheaper)
    dominating = [n for n, point in statics.items() if dominates(point, ours)]
    wide, by_seed = verdict(trace, verdict_seeds)
    extra_gpu, extra_idle = distances(ours, limit)
    verdict_line = (
        f"- {name}{held}: ours idles {ours['trainer_idle_fraction']:.3f} on {ours['gpu_seconds']:.0f} GPU-s; "
        f"to the limit {_fmt_gpu(extra_gpu, ours['gpu_seconds'])} GPU-s at no more idle, "
        f"{_fmt_idle(extra_idle)} idle at no more GPU-s; policies using no more GPU-s "
        f"({', '.join(cheaper) or 'none'}) idle {'more' if best else 'LESS OR EQUAL'}; "
        f"reversals {ours['reversals']:.0f}; "
        + (f"DOMINATED by static {', '.join(map(str, dominating))}" if dominating
           else "not dominated by any fixed count")
        + f"; over {verdict_seeds} seeds: " + (f"DOMINATED by static {', '.join(map(str, wide))}" if wide
                                               else "not dominated")
        + f", dominated seed by seed on {by_seed} of {verdict_seeds}")
    topm, thr = med["static-max"], med["threshold"]
    headline = (
        f"autoscaler, `{name}` trace{held} (simulated): trainer idle / GPU-s, reversals; to the limit",
        f"{ours['trainer_idle_fraction']:.3f} / {ours['gpu_seconds']:,.0f}, {ours['reversals']:.0f}; "
        f"{_fmt_gpu(extra_gpu, ours['gpu_seconds'])} GPU-s, {_fmt_idle(extra_idle)} idle",
        f"static-max {topm['trainer_idle_fraction']:.3f} / {topm['gpu_seconds']:,.0f}; "
        f"threshold ±1 {thr['trainer_idle_fraction']:.3f} / {thr['gpu_seconds']:,.0f}",
        f"GPU-s {ours['gpu_seconds'] / topm['gpu_seconds']:.2f}x static-max; "
        + (f"dominated by static {', '.join(map(str, wide))}" if wide else "not dominated by any fixed count")
        + f" over {verdict_seeds} seeds; on {by_seed} of them seed by seed")
    return lines, verdict_line, headline


def run(seeds: int, slacks: tuple[float, ...], headline: list[tuple[str, str, str, str]] | None = None,
        command: str = "", verdict_seeds: int = 20, jobs: int = 1,
        names: tuple[str, ...] = (*TRACE_NAMES, *HELD_OUT)) -> str:
    started = time.perf_counter()
    lines = ["# Autoscaler policy benchmark (simulated)", "",
             f"`{command}`: medians over seeds 0..{seeds - 1} of each trace in `examples/traces/` "
             f"(`{'`, `'.join(HELD_OUT)}` held out from tuning). The limit: the lower frontier of the "
             f"clairvoyant schedules (slacks {', '.join(f'{s:g}' for s in slacks)}) and every fixed count. "
             "Extra GPU-s: over the limit at the same idle; extra idle: over the limit at the same GPU-s; "
             "the limit is piecewise linear between frontier points (- : outside its range).", ""]
    section = functools.partial(trace_section, seeds=seeds, slacks=slacks, verdict_seeds=verdict_seeds)
    if jobs > 1:  # one process per trace at a time: the simulator is pure, so the figures are the same
        with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
            sections = list(pool.map(section, names))
    else:
        sections = [section(name) for name in names]
    verdicts = []
    for trace_lines, verdict_line, row in sections:
        lines += trace_lines
        verdicts.append(verdict_line)
        if headline is not None:
            headline.append(row)
    lines += ["## Reading", "",
              "Static allocation at the maximum idles least, at the most GPU-seconds; the question is the "
              "trade-off. Ours is dominated when some fixed count idles no more on no more GPU-seconds "
              "(one strictly). The clairvoyant schedules know the trace (a greedy search over the simulator, "
              "120 s intervals): the physical limit lies at or below their frontier.", "", *verdicts, "",
              f"Wall time of the whole benchmark: {time.perf_counter() - started:.1f} s.", ""]
    return "\n".join(lines)


def random_section(count: int, jobs: int) -> str:
    """Ours against the fixed counts on the first ``count`` random traces (bench/random_traces.py)."""
    from bench.random_traces import verdicts

    code = str(Path(__file__).resolve().parents[1])
    lines = list(verdicts(range(count), RANDOM_SEEDS, jobs, code, code))
    return "\n".join(["## Random traces", "", f"Traces drawn by `bench/random_traces.py` (trace i from seed i), "
                      f"no policy tuned on them; ours against the fixed counts, {RANDOM_SEEDS} seeds "
                      f"(`bench/bench_policy.py --random {count}`):", "", *[f"- {line}" for line in lines], ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 5; 2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="2 seeds, 3 clairvoyant slacks, verdicts over 5")
    parser.add_argument("--verdict-seeds", type=int, default=None,
                        help="seeds of ours and every fixed count for the domination verdict (default 20)")
    parser.add_argument("--jobs", type=int, default=1, help="traces run at once, one process each (default 1)")
    parser.add_argument("--traces", default="", help="comma-separated trace names (default: every shipped trace)")
    parser.add_argument("--random", type=int, default=0, metavar="N",
                        help="also judge ours on the first N traces of bench/random_traces.py (10 seeds; default 0)")
    args = parser.parse_args()
    names = tuple(n for n in args.traces.split(",") if n) or (*TRACE_NAMES, *HELD_OUT)
    unknown = sorted(set(names) - {*TRACE_NAMES, *HELD_OUT})
    if unknown:
        parser.error(f"unknown trace(s) {', '.join(unknown)}; shipped: {', '.join((*TRACE_NAMES, *HELD_OUT))}")
    seeds = args.seeds or (2 if args.quick else 5)
    verdict_seeds = args.verdict_seeds or (5 if args.quick else 20)
    slacks = SLACKS_QUICK if args.quick else SLACKS_FULL
    command = "bench/bench_policy.py" + (" --quick" if args.quick else "") + (
        f" --seeds {args.seeds}" if args.seeds else "") + (f" --traces {args.traces}" if args.traces else "")
    headline: list[tuple[str, str, str, str]] = []
    report = run(seeds, slacks, headline, command, verdict_seeds, args.jobs, names)
    if args.random:
        report += random_section(args.random, args.jobs)
    write_report("policy", report)
    write_headline("policy", headline)


if __name__ == "__main__":
    main()
