"""Controller figures on a dev cluster: decision -> worker running, drain, reattach, RPCs per tick.

    ./run setup && .venv/bin/python bench/bench_controller.py      # as root; ~3 minutes
    .venv/bin/python bench/bench_controller.py --launch-only       # decision -> registered and its baseline only

It brings up its own bench cluster (8 nodes x 8 fake GPUs = 64 GPU slots, ports 19817/19901+,
node prefix "bn") so the 64-worker figures fit, and takes it down afterwards. Baselines measured
in the same run: a bare `srun` of the same worker command (launch latency), and one squeue call
per worker per tick (RPCs).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import median, percentile, write_headline, write_report
from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import (
    ControllerJob,
    start_controller_job,
    stop_controller_job,
    wait_for,
)


def rpc_totals(slurm: SlurmCli) -> tuple[int, int]:
    counts = slurm.rpc_counts()
    return counts.get("REQUEST_JOB_STEP_INFO", 0), sum(counts.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launch-only", action="store_true", help="only decision -> registered and its baseline")
    args = parser.parse_args()
    spec = DevClusterSpec(dir=Path(tempfile.gettempdir()) / "se-bench-cluster", nodes=8, gpus_per_node=8,
                          cpus_per_node=16, memory_per_node_mb=8000, ctld_port=19817, node_base_port=19901,
                          cluster_name="bench", node_prefix="bn")
    cluster = DevCluster(spec)
    cluster.up(wait_s=120)
    os.environ["SLURM_CONF"] = str(cluster.conf_path)
    slurm = SlurmCli()
    rows: list[str] = []
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            rows += run_all(cluster, Path(tmp_name), slurm, launch_only=args.launch_only)
    finally:
        cluster.down()
    write_report("controller-launch" if args.launch_only else "controller", "\n".join(["## Controller (bench cluster: 8 nodes x 8 fake GPUs, Slurm 22.05)", "",
                                          "| figure | value |", "|---|---|", *rows, ""]))


def transition_s(worker: dict[str, Any], state: str) -> float:
    """When ``worker`` last entered ``state``, on the controller's clock (time.time on this host)."""
    return max(float(t) for t, _before, after, _why in worker["history"] if after == state)


def launch_once(job: ControllerJob, n: int) -> tuple[float, float, float]:
    """Scale to ``n`` and wait for it; (decision -> registered, decision -> srun spawned,
    spawned -> registered) of the new worker, in s, from the controller's own timestamps."""
    client = job.client()
    before = {w["worker_id"] for w in job.status()["workers"]}
    t0 = time.time()
    client.scale(n)
    client.close()
    status = job.active(n, timeout_s=60)
    new = [w for w in status["workers"] if w["worker_id"] not in before and w["state"] == "ACTIVE"]
    actives = sorted((transition_s(w, "ACTIVE"), transition_s(w, "STARTING")) for w in new)
    active, started = actives[-1]
    return active - t0, started - t0, active - started


def run_all(cluster: DevCluster, tmp: Path, slurm: SlurmCli, launch_only: bool = False) -> list[str]:
    job = start_controller_job(cluster, tmp / "run", nodes=8, gpus_per_node=8,
                               workers={"heartbeat_interval_s": 1.0, "heartbeat_grace_s": 30.0},
                               worker_env={"ROLLOUT_S": "0.5"})
    rows = []
    try:
        client = job.client()
        # 1. decision -> worker registered, one worker at a time
        launches = [launch_once(job, n) for n in range(1, 13)]
        launch_s = [t for t, _, _ in launches]
        # baseline: the bare srun of the same command (no controller), until its process runs
        bare_s = []
        for i in range(8):
            marker = tmp / f"bare{i}"
            t0 = time.perf_counter()
            run_command(["srun", f"--jobid={job.job_id}", "--exact", "--nodes=1", "--ntasks=1", "--gres=gpu:1",
                         "--overlap", sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"])
            bare_s.append(time.perf_counter() - t0)
        if launch_only:
            client.close()
            return launch_rows(launches, bare_s)
        # 2. drain: scale down by one, until its step has ended
        drain_s = []
        for n in range(11, 5, -1):
            before = set(job.worker_steps())
            t0 = time.perf_counter()
            client.scale(n)
            wait_for(lambda b=before, k=n: len(set(job.worker_steps()) & b) == k, 60, "a drained step to end")
            drain_s.append(time.perf_counter() - t0)
        # 3. RPCs per tick at 8 and 64 workers
        rpc_rows = []
        for n in (8, 64):
            client.scale(n)
            job.active(n, timeout_s=240)
            ticks0, (step0, all0) = job.status()["ticks"], rpc_totals(slurm)
            time.sleep(6.0)
            ticks1, (step1, all1) = job.status()["ticks"], rpc_totals(slurm)
            ticks = max(1, ticks1 - ticks0)
            rpc_rows.append(f"| slurmctld RPCs per tick at {n} workers: step listings / all types "
                            f"(baseline: one call per worker = {n}) | {(step1 - step0) / ticks:.2f} / "
                            f"{(all1 - all0) / ticks:.2f} |")
        # 4. reattach with 64 running steps: kill -9, until the new controller has adopted all 64
        before_steps = set(job.worker_steps())
        pid = job.controller_pid()
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: job.controller_pid() != pid, 60, "a new controller")
        status = job.active(64, timeout_s=120)
        reattach_s = time.perf_counter() - t0
        relaunched = sum(1 for w in status["workers"] if w["launches"] > 1)
        same_steps = set(job.worker_steps()) == before_steps
        client.close()
    finally:
        stop_controller_job(job)
    rows += [
        *launch_rows(launches, bare_s),
        f"| drain (scale down by one -> step ended; rollouts 0.5 s), p50 / p95 | "
        f"{median(drain_s) * 1000:.0f} ms / {percentile(drain_s, 95) * 1000:.0f} ms |",
        *rpc_rows,
        f"| reattach after kill -9 with 64 running steps (kill -> all 64 adopted, incl. 0.3 s restart delay) | "
        f"{reattach_s:.1f} s, {relaunched} relaunched, same steps: {same_steps} |",
    ]
    write_headline("controller", [
        *launch_headline(launch_s, bare_s),
        ("drain: scale down by one -> step ended (0.5 s rollouts), p50", f"{median(drain_s) * 1000:.0f} ms", "", ""),
        ("reattach after kill -9 with 64 running steps", f"{reattach_s:.1f} s, {relaunched} relaunched",
         "relaunching 64", ""),
    ])
    return rows


def launch_rows(launches: list[tuple[float, float, float]], bare_s: list[float]) -> list[str]:
    total, spawned, registered = ([x[i] for x in launches] for i in range(3))
    return [
        f"| decision -> worker registered, p50 / p95 ({len(total)} scale-ups, tick 0.3 s; the controller's "
        f"timestamps) | {median(total) * 1000:.0f} ms / {percentile(total, 95) * 1000:.0f} ms |",
        f"| of which decision -> srun spawned (the loop's wake-up and the tick's listing), p50 | "
        f"{median(spawned) * 1000:.0f} ms |",
        f"| of which srun spawned -> registered (srun, the wrapper's start, the registration), p50 | "
        f"{median(registered) * 1000:.0f} ms |",
        f"| baseline: bare srun of a Python command, p50 | {median(bare_s) * 1000:.0f} ms |",
    ]


def launch_headline(launch_s: list[float], bare_s: list[float]) -> list[tuple[str, str, str, str]]:
    return [("scale decision -> worker registered, p50 (vs a bare `srun` of a Python command)",
             f"{median(launch_s) * 1000:.0f} ms", f"{median(bare_s) * 1000:.0f} ms",
             f"{median(launch_s) / median(bare_s):.1f}x")]


if __name__ == "__main__":
    main()
