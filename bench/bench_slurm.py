"""Slurm adapter figures on the dev cluster: launch latency, listing cost at N steps, RPCs per listing.

    ./run setup && eval "$(.venv/bin/slurm-elastic devcluster up)" && .venv/bin/python bench/bench_slurm.py

The baseline for listing is what a naive controller does: one ``squeue`` call per worker.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import median, percentile, write_headline, write_report
from slurm_elastic.devcluster.cluster import DevCluster, default_dir
from slurm_elastic.slurm.backend import StepSpec
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.runner import run_command


def _submit_allocation() -> int:
    out = run_command(["sbatch", "--parsable", "--nodes=2", "--exclusive", "--gres=gpu:4", "--mem=0",
                       "--job-name=se-bench", "--output=/dev/null", "--wrap", "sleep 100000"]).stdout
    job_id = int(out.strip().split(";")[0])
    while run_command(["squeue", "-h", "-j", str(job_id), "-o", "%T"]).stdout.strip() != "RUNNING":
        time.sleep(0.1)
    return job_id


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--launch-samples", type=int, default=12)
    parser.add_argument("--list-repeats", type=int, default=15)
    args = parser.parse_args()
    import os

    os.environ["SLURM_CONF"] = str(DevCluster.at(default_dir()).conf_path)
    slurm = SlurmCli()
    job_id = _submit_allocation()
    tmp = Path("/tmp/se-bench-slurm")
    tmp.mkdir(exist_ok=True)
    try:
        # 1. launch latency: srun spawned -> step visible in squeue (GPU steps, one at a time)
        launch_s = []
        for i in range(args.launch_samples):
            name = f"se-w-lat{i}"
            t0 = time.perf_counter()
            slurm.launch_step(StepSpec(job_id=job_id, name=name, argv=("sleep", "600"),
                                       output_path=tmp / f"{name}.out", gpus=1), tmp / "launch.log")
            while not any(s.name == name for s in slurm.list_steps(job_id)):
                time.sleep(0.01)
            launch_s.append(time.perf_counter() - t0)
            step = next(s for s in slurm.list_steps(job_id) if s.name == name)
            slurm.cancel_step(job_id, step.step_id)
        # 2. listing at N steps (no GPUs, overlapping, so N fits on the dev cluster)
        for i in range(args.steps):
            slurm.launch_step(StepSpec(job_id=job_id, name=f"se-w-many{i}", argv=("sleep", "600"),
                                       output_path=Path("/dev/null"), gpus=0, overlap=True), tmp / "many.log")
        deadline = time.monotonic() + 120
        while len([s for s in slurm.list_steps(job_id) if s.name.startswith("se-w-many")]) < args.steps:
            if time.monotonic() > deadline:
                raise SystemExit("steps did not all start")
            time.sleep(0.5)
        steps = [s for s in slurm.list_steps(job_id) if s.name.startswith("se-w-many")]
        batched_s, rpcs = [], []
        for _ in range(args.list_repeats):
            before = slurm.rpc_counts().get("REQUEST_JOB_STEP_INFO", 0)
            t0 = time.perf_counter()
            slurm.list_steps(job_id)
            batched_s.append(time.perf_counter() - t0)
            rpcs.append(slurm.rpc_counts().get("REQUEST_JOB_STEP_INFO", 0) - before)
        per_worker_s = []
        for _ in range(3):
            t0 = time.perf_counter()
            for step in steps:
                run_command(["squeue", "--steps", f"--step={step.step_ref}", "--noheader", "--format=%i"])
            per_worker_s.append(time.perf_counter() - t0)
    finally:
        run_command(["scancel", str(job_id)], check=False)
    ratio = median(per_worker_s) / median(batched_s)
    write_report("slurm", "\n".join([
        "## Slurm adapter (dev cluster, Slurm 22.05)",
        "",
        "| figure | value |",
        "|---|---|",
        f"| srun launch -> step listed, p50 / p95 ({len(launch_s)} launches) | "
        f"{median(launch_s) * 1000:.0f} ms / {percentile(launch_s, 95) * 1000:.0f} ms |",
        f"| list all steps at {args.steps} steps, one `squeue --steps` call, median of {len(batched_s)} | "
        f"{median(batched_s) * 1000:.1f} ms |",
        f"| slurmctld step-info RPCs per listing (sdiag) | {median([float(r) for r in rpcs]):.0f} |",
        f"| baseline: one squeue call per worker, {args.steps} workers, median of {len(per_worker_s)} | "
        f"{median(per_worker_s) * 1000:.0f} ms |",
        f"| batched listing is faster than per-worker calls by | {ratio:.0f}x |",
        "",
    ]))
    write_headline("slurm", [
        ("srun launch -> step listed, p50", f"{median(launch_s) * 1000:.0f} ms", "", ""),
        (f"list {args.steps} steps (one `squeue --steps`) vs one call per worker",
         f"{median(batched_s) * 1000:.1f} ms", f"{median(per_worker_s) * 1000:.0f} ms", f"{1 / ratio:.3f}x"),
    ])


if __name__ == "__main__":
    main()
