"""Where over a trace ours gains or loses against fixed counts: trainer idle and GPU-seconds
accumulated by each cut-off time, means over seeds (the table "where big_batch_pareto loses" in
docs/autoscaler.md).

    .venv/bin/python bench/policy_phases.py big_batch_pareto --counts 12,24 --cuts 300,600,1200,1800,2400

Each cut-off is a run of the trace ending there (the same seed replays the same run up to it),
so a column is what each policy had spent by then: idle seconds / GPU-seconds. Pure simulation.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

from slurm_elastic.sim.engine import simulate
from slurm_elastic.sim.output import load_trace
from slurm_elastic.sim.trace import Trace

TRACES = Path(__file__).resolve().parent.parent / "examples" / "traces"


def spent(trace: Trace, policy: str, count: int, cut_s: float, seeds: int) -> tuple[float, float]:
    """Mean trainer idle [s] and GPU-seconds of ``policy`` (a fixed ``count`` for static-mid) by ``cut_s``."""
    cut = dataclasses.replace(trace, duration_s=cut_s)
    if policy == "static-mid":
        cut = dataclasses.replace(cut, baselines=dataclasses.replace(cut.baselines, static_mid_workers=count))
    runs = [simulate(cut, policy, seed).metrics for seed in range(seeds)]
    return (statistics.mean(m["trainer_idle_fraction"] * cut_s for m in runs),
            statistics.mean(m["gpu_seconds"] for m in runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a trace name in examples/traces")
    parser.add_argument("--counts", default="12", help="comma-separated fixed counts to compare with")
    parser.add_argument("--cuts", default="300,600,1200,1800,2400", help="comma-separated cut-off times [s]")
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args()
    trace = load_trace(TRACES / f"{args.trace}.toml")
    cuts = [float(c) for c in args.cuts.split(",")]
    print("| | " + " | ".join(f"{c:.0f} s" for c in cuts) + " |")
    print("|---" * (len(cuts) + 1) + "|")
    rows = [("ours", "ours", 0)] + [(f"static {n}", "static-mid", int(n)) for n in args.counts.split(",")]
    for label, policy, count in rows:
        cells = [spent(trace, policy, count, c, args.seeds) for c in cuts]
        print(f"| {label} | " + " | ".join(f"{idle:.1f} / {gpu:,.0f}" for idle, gpu in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
