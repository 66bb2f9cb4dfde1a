"""Burst jobs in the simulator: GPU-hours held and trainer idle, against a static allocation sized for the peak.

    .venv/bin/python bench/bench_burst.py [--seeds N] [--quick]

Five traces of `examples/traces/` (steady, bursty, ramp, phase_shift, speedup_bursts) run with
the controller's policy three ways: in a static
allocation of the trace's `gpu_slots` (the peak), in a 4-slot allocation alone, and in that
allocation with burst jobs of 4 slots (as many as the peak needs), each waiting in Slurm's queue
(exponential, mean 120 s) and preempted at 1 per job-hour. Medians over seeds; writes
bench/out/burst.md and bench/out/burst.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import OUT_DIR, write_headline, write_report
from slurm_elastic.sim.burst_model import BurstClusterSpec, BurstComparison, compare_burst
from slurm_elastic.sim.output import load_trace

TRACES = Path(__file__).resolve().parents[1] / "examples" / "traces"
NAMES = ("steady", "bursty", "ramp", "phase_shift", "speedup_bursts")
SETTINGS = ("static_peak", "allocation_only", "allocation_plus_burst")
ALLOCATION_SLOTS, SLOTS_PER_JOB, QUEUE_WAIT_S, PREEMPTIONS_PER_HOUR = 4, 4, 120.0, 1.0


def run_trace(name: str, seeds: int) -> list[BurstComparison]:
    trace = load_trace(TRACES / f"{name}.toml")
    spec = BurstClusterSpec(allocation_slots=ALLOCATION_SLOTS, slots_per_job=SLOTS_PER_JOB,
                            max_jobs=-(-(trace.cluster.gpu_slots - ALLOCATION_SLOTS) // SLOTS_PER_JOB),
                            queue_wait_mean_s=QUEUE_WAIT_S, preemptions_per_job_hour=PREEMPTIONS_PER_HOUR)
    return [compare_burst(trace, spec, seed) for seed in range(seeds)]


def med(values: list[float]) -> float:
    return statistics.median(values)


def run(seeds: int, command: str, headline: list[tuple[str, str, str, str]] | None = None) -> str:
    started = time.perf_counter()
    lines = ["# Burst jobs (simulated)", "", f"`{command}`: medians over seeds 0..{seeds - 1}. " + __doc__.split("\n\n")[2]
             .replace("\n", " "), "",
             "| trace | peak slots | GPU-h held: static peak (used) | allocation only | allocation + burst "
             "| trainer idle: static peak | allocation only | allocation + burst | burst jobs | preemptions "
             "| mean queue wait |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    figure: dict[str, dict[str, tuple[float, float]]] = {}
    shares, extra_idle = [], []
    for name in NAMES:
        runs = run_trace(name, seeds)
        held = {s: med([r.gpu_hours[s] for r in runs]) for s in SETTINGS}
        idle = {s: med([r.trainer_idle_fraction[s] for r in runs]) for s in SETTINGS}
        figure[name] = {s: (held[s], idle[s]) for s in SETTINGS}
        used = med([r.static_peak_used_gpu_hours for r in runs])
        shares.append(held["allocation_plus_burst"] / held["static_peak"])
        extra_idle.append(idle["allocation_plus_burst"] - idle["static_peak"])
        lines.append(
            f"| {name} | {runs[0].peak_slots} | {held['static_peak']:.2f} ({used:.2f}) | {held['allocation_only']:.2f} | "
            f"{held['allocation_plus_burst']:.2f} ({held['allocation_plus_burst'] / held['static_peak']:.0%}) | "
            f"{idle['static_peak']:.3f} | {idle['allocation_only']:.3f} | {idle['allocation_plus_burst']:.3f} | "
            f"{med([r.burst_jobs_submitted for r in runs]):.0f} | {med([r.preemptions for r in runs]):.0f} | "
            f"{med([r.mean_queue_wait_s for r in runs]):.0f} s |")
    lines += ["", "GPU-hours held are what the cluster charges: a static allocation holds its GPUs whether "
              "workers use them or not (used: the GPU-hours its workers ran); burst jobs hold theirs from "
              "start to cancel or preemption.", "", f"Wall time: {time.perf_counter() - started:.1f} s.", ""]
    _plot(figure, OUT_DIR / "burst.png")
    if headline is not None:
        headline.append((
            f"burst jobs ({len(NAMES)} traces, simulated): GPU-hours held and trainer idle, a {ALLOCATION_SLOTS}-slot "
            f"allocation + burst jobs (queue wait {QUEUE_WAIT_S:g} s, {PREEMPTIONS_PER_HOUR:g} preemption/job-hour)",
            f"{min(shares):.0%}-{max(shares):.0%} of the GPU-hours; idle +{min(extra_idle):.3f} to +{max(extra_idle):.3f}",
            "a static allocation sized for the peak", f"GPU-hours {min(shares):.2f}-{max(shares):.2f}x"))
    return "\n".join(lines)


def _plot(figure: dict[str, dict[str, tuple[float, float]]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax_held, ax_idle) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.27
    for i, setting in enumerate(SETTINGS):
        xs = [n + (i - 1) * width for n in range(len(figure))]
        ax_held.bar(xs, [v[setting][0] for v in figure.values()], width, label=setting.replace("_", " "))
        ax_idle.bar(xs, [v[setting][1] for v in figure.values()], width, label=setting.replace("_", " "))
    for ax, title in ((ax_held, "GPU-hours held"), (ax_idle, "trainer idle fraction")):
        ax.set_xticks(range(len(figure)), list(figure), rotation=20)
        ax.set_title(title)
    ax_held.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 5; 2 with --quick)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    seeds = args.seeds or (2 if args.quick else 5)
    command = "bench/bench_burst.py" + (" --quick" if args.quick else "") + (f" --seeds {args.seeds}" if args.seeds else "")
    headline: list[tuple[str, str, str, str]] = []
    write_report("burst", run(seeds, command, headline))
    write_headline("burst", headline)


if __name__ == "__main__":
    main()
