"""The chaos soak, long form: the controller under load while a seeded fault schedule runs for
``--duration-s`` (kill -9 of the controller mid scale-up / mid drain / between batch hand-out and
ack, worker kills, slurmd restarts, GPU faults), then every invariant is checked.

    .venv/bin/python bench/bench_chaos.py --duration-s 600 --seed 7     # as root
    .venv/bin/python bench/bench_chaos.py --quick                       # two rounds of faults, ~1-2 min

It brings up its own cluster (2 nodes x 4 fake GPUs, ports 20817/20901+, node prefix "cn"),
since it restarts a slurmd, and takes it down afterwards. The baseline, measured in the same run:
the same load with no faults (rollouts delivered per second per live worker). Writes
bench/out/chaos.md; exits 1 if any invariant was violated.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write_headline, write_report
from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec
from tests.cluster.chaos import ChaosResult, ChaosSettings, run_chaos

SPEC = DevClusterSpec(dir=Path(tempfile.gettempdir()) / "se-chaos-cluster", ctld_port=20817, node_base_port=20901,
                      cluster_name="chaos", node_prefix="cn")


def report(result: ChaosResult, settings: ChaosSettings) -> str:
    c = result.counts
    (base_rate, base_workers), (chaos_rate, chaos_workers) = result.baseline, result.chaos
    base_per_worker = base_rate / base_workers if base_workers else 0.0
    chaos_per_worker = chaos_rate / chaos_workers if chaos_workers else 0.0
    ratio = f"{chaos_per_worker / base_per_worker:.2f}" if base_per_worker else "n/a"
    schedule = f"{settings.duration_s:g} s of faults" if settings.duration_s else f"{settings.rounds} rounds of faults"
    rows = [
        ("controller kill -9 survived (total)", c["controller_kills"]),
        ("  mid scale-up", c["kill_controller_scale_up"]),
        ("  mid drain", c["kill_controller_drain"]),
        ("  between batch hand-out and ack", c["kill_controller_handout"]),
        ("  twice: again while the next one starts up (counted as 2)", c["kill_controller_recovery"]),
        ("worker kill -9 (worker process or its step's wrapper)", c["kill_worker"]),
        ("slurmd restarts (kill -9, start)", c["restart_slurmd"]),
        ("  workers on that node that kept running (or drained)", f"{c['workers_kept_across_slurmd_restart']} of "
                                                     f"{c['workers_across_slurmd_restart']}"),
        ("worker exits neither drained nor killed by the soak", c["unexplained_worker_exits"]),
        ("GPU faults injected (drill file; cordon, then clear)", c["gpu_fault"]),
        ("cordons seen", c["cordons_seen"]),
        ("worker starts", c["worker_starts"]),
        ("  of them on a node while one of its GPUs was cordoned", c["starts_under_a_cordon"]),
        ("rollouts checked (acknowledged by the controller)", result.rollouts_checked),
        ("batches acknowledged by the trainer", result.batches),
        ("rollouts/s, no faults (mean live workers)", f"{base_rate:.1f} ({base_workers:.1f})"),
        ("rollouts/s, under faults (mean live workers)", f"{chaos_rate:.1f} ({chaos_workers:.1f})"),
        ("per-worker throughput under faults / without", ratio),
        ("**violations**", f"**{len(result.violations)}**"),
    ]
    lines = [f"## Chaos soak (seed {result.seed}, {schedule}, {result.duration_s:.0f} s in all; "
             "2 nodes x 4 fake GPUs, Slurm 22.05)", "", result.summary(), "", "| figure | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    lines += ["", *[f"- {note}" for note in result.notes]]
    if result.violations:
        lines += ["", "### Violations", "", *[f"- {v}" for v in result.violations[:100]]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0, help="how long the faults go on")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="two rounds of faults instead of --duration-s")
    parser.add_argument("--baseline-s", type=float, default=None, help="fault-free load first (default: 20, quick: 10)")
    args = parser.parse_args(argv)
    baseline_s = args.baseline_s if args.baseline_s is not None else (10.0 if args.quick else 20.0)
    settings = ChaosSettings(seed=args.seed, duration_s=0.0 if args.quick else args.duration_s, baseline_s=baseline_s)
    cluster = DevCluster(SPEC)
    cluster.up(wait_s=120)
    os.environ["SLURM_CONF"] = str(cluster.conf_path)
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            result = run_chaos(cluster, Path(tmp_name), settings)
    finally:
        cluster.down()
    write_report("chaos", report(result, settings))
    c = result.counts
    (base_rate, base_workers), (chaos_rate, chaos_workers) = result.baseline, result.chaos
    per_worker = (chaos_rate / chaos_workers) / (base_rate / base_workers) if base_workers and chaos_workers \
        and base_rate else float("nan")
    write_headline("chaos", [
        (f"chaos soak ({result.duration_s:.0f} s): controller kill -9 / worker kills / slurmd restarts / GPU faults",
         f"{c['controller_kills']} / {c['kill_worker']} / {c['restart_slurmd']} / {c['gpu_fault']}, "
         f"{result.rollouts_checked} rollouts checked, **{len(result.violations)} violations**",
         "the same load without faults", f"{per_worker:.2f}x rollouts/s per worker"),
    ])
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main())
