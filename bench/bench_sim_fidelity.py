"""The simulator against the real controller: one trace run both ways, side by side.

    .venv/bin/python bench/bench_sim_fidelity.py [TRACE.toml ...] [--seeds 10] [--sim-only] [--real-json F]

Real: a controller job on the dev cluster (``SLURM_ELASTIC_DEVCLUSTER_DIR``; 2 nodes x
``gpu_slots / 2`` fake GPUs) with the trace's settings (tick, cooldowns, windows, the staleness
bound, batch and capacity, the whole ``[autoscaler]`` table), workers that act the trace
(``bench/_fidelity_worker.py``: real srun steps, the worker SDK over HTTP) and a trainer here
that pulls with the trainer helper and sleeps the trace's step time, for the trace's
``duration_s``. The controller's status is read every 0.5 s. Sim: ``slurm-elastic simulate`` of
the same trace, ``--seeds`` seeds. Figures: the worker count (starting + active + draining) per
30 s (median), target changes (count, direction, first scale-up), the trainer's idle fraction,
GPU-seconds (the integral of that count), sequences dropped or refused stale, and the largest
staleness a batch held. Writes bench/out/sim_fidelity.md (and .json: the real runs' figures,
which ``--real-json`` reads back to re-report without the cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import OUT_DIR, write_report
from slurm_elastic.sim.engine import simulate
from slurm_elastic.sim.output import load_trace
from slurm_elastic.sim.trace import Trace

HERE = Path(__file__).resolve().parent
TRACES = (HERE / "fidelity" / "steady_small.toml", HERE / "fidelity" / "phase_small.toml")
WINDOW_S = 30.0
POLL_S = 0.5


def figures(times_s: list[float], counts: list[float], targets: list[int], idle_s: float, duration_s: float,
            dropped: float, max_staleness: float, steps: float) -> dict[str, Any]:
    """The compared figures from a run's samples (time, worker count, target) and totals."""
    per_window = []
    for start in range(0, int(duration_s), int(WINDOW_S)):
        inside = [c for t, c in zip(times_s, counts, strict=True) if start <= t < start + WINDOW_S]
        per_window.append(statistics.median(inside) if inside else float("nan"))
    gpu_s = sum(c * (b - a) for a, b, c in zip(times_s, [*times_s[1:], duration_s], counts, strict=True))
    changes = [(round(t, 1), a, b) for t, a, b in zip(times_s[1:], targets, targets[1:], strict=False) if b != a]
    ups = [t for t, a, b in changes if b > a]
    return {"workers_per_window": per_window, "changes": changes, "target_changes": len(changes), "ups": len(ups),
            "downs": len(changes) - len(ups), "first_up_s": ups[0] if ups else None,
            "idle_fraction": idle_s / duration_s, "gpu_s": gpu_s, "dropped_stale_seqs": dropped,
            "max_staleness": max_staleness, "trainer_steps": steps}


def run_sim(trace: Trace, seed: int) -> dict[str, Any]:
    result = simulate(trace, "ours", seed)
    s = result.samples
    m = result.metrics
    times = [0.0, *[x.t_s for x in s]]
    counts = [float(s[0].starting + s[0].active + s[0].draining) if s else 0.0,
              *[float(x.starting + x.active + x.draining) for x in s]]
    targets = [trace.cluster.initial_workers, *[x.target for x in s]]
    out = figures(times, counts, targets, m["trainer_idle_fraction"] * trace.duration_s, trace.duration_s,
                  m["dropped_stale_seqs"], m["max_staleness"], m["trainer_steps"])
    out["gpu_s_counted"] = m["gpu_seconds"]  # launch to exit, as the simulator counts it
    return out


# ---- the real run ---------------------------------------------------------------------------
class TrainerThread(threading.Thread):
    """Pulls batches, sleeps the trace's step time, acks, publishes version + 1; counts its waits."""

    def __init__(self, trace: Trace, url: str, token: str, version_file: Path, t0_s: float) -> None:
        super().__init__(daemon=True)
        from slurm_elastic.trainer import Trainer

        self.trace, self.version_file, self.t0_s = trace, version_file, t0_s
        self.trainer = Trainer(url, token)
        self.idle_s = 0.0
        self.max_staleness = 0
        self.steps = 0
        self.stop = threading.Event()
        self.rng = random.Random(trace.seed)

    def run(self) -> None:
        t = self.trace
        version = 0
        self.trainer.publish_version(0)
        end_s = self.t0_s + t.duration_s
        while not self.stop.is_set() and time.time() < end_s:
            asked_s = time.time()
            batch = self.trainer.next_batch(timeout_s=max(0.1, end_s - asked_s))
            got_s = time.time()
            self.idle_s += min(got_s, end_s) - asked_s
            if batch is None:
                break
            self.max_staleness = max([self.max_staleness, *(version - int(g["policy_version"]) for g in batch.groups)])
            j = t.trainer.step_jitter
            scale = t.phase_at(got_s - self.t0_s).trainer_scale * (1 + j * (2 * self.rng.random() - 1))
            time.sleep(t.trainer.step_s * max(0.01, scale))
            self.trainer.ack(batch)
            version += 1
            self.trainer.publish_version(version)
            tmp = self.version_file.with_suffix(".tmp")
            tmp.write_text(str(version))
            tmp.replace(self.version_file)
            self.steps += 1


def run_real(trace_path: Path, trace: Trace, tmp: Path) -> dict[str, Any]:
    from slurm_elastic.devcluster.cluster import DevCluster
    from tests.cluster.controller_harness import (
        locate_in,
        start_controller_job,
        stop_controller_job,
    )

    here = os.environ.get("SLURM_ELASTIC_DEVCLUSTER_DIR")
    if not here:
        raise SystemExit("set SLURM_ELASTIC_DEVCLUSTER_DIR to the dev cluster's directory")
    cluster = DevCluster.at(Path(here))
    os.environ["SLURM_CONF"] = str(cluster.conf_path)
    c, q = trace.cluster, trace.queue
    t0_file, version_file = tmp / "t0", tmp / "version"
    tmp.mkdir(parents=True, exist_ok=True)
    version_file.write_text("0")
    job = start_controller_job(
        cluster, tmp, nodes=2, gpus_per_node=-(-c.gpu_slots // 2),
        workers={"command": [sys.executable, str(HERE / "_fidelity_worker.py"), str(trace_path.resolve())],
                 "initial_workers": c.initial_workers, "heartbeat_grace_s": c.heartbeat_grace_s,
                 "drain_timeout_s": c.drain_timeout_s, "backoff_base_s": c.backoff_base_s,
                 "backoff_max_s": c.backoff_max_s, "start_timeout_s": 60.0},
        worker_env={"FIDELITY_T0_FILE": str(t0_file), "FIDELITY_VERSION_FILE": str(version_file)},
        agent={"enabled": False},
        controller={"tick_interval_s": c.tick_interval_s},
        queue={"batch_size": q.batch_size, "capacity_seqs": q.capacity_seqs, "max_staleness": q.max_staleness,
               "max_concurrent": q.max_concurrent, "admission_ttl_s": int(q.admission_ttl_s)},
        autoscaler=asdict(trace.autoscaler))
    try:
        status = job.status()
        t0_s = time.time() - float(status["uptime_s"])  # the controller's start: its first tick launches
        t0_file.write_text(repr(t0_s))
        url, token = locate_in(job.state_dir, job.job_id)
        trainer = TrainerThread(trace, url, token, version_file, t0_s)
        trainer.idle_s = time.time() - t0_s  # waiting since t = 0
        trainer.start()
        times: list[float] = []
        counts: list[float] = []
        targets: list[int] = []
        last: dict[str, Any] = {}
        with job.client() as client:
            while (now := time.time()) < t0_s + trace.duration_s:
                try:
                    st = client.status()
                except Exception:  # a missed poll: the next one reads it
                    time.sleep(POLL_S)
                    continue
                by = st["workers_by_state"]
                times.append(now - t0_s)
                counts.append(float(by["STARTING"] + by["ACTIVE"] + by["DRAINING"]))
                targets.append(int(st["target_workers"]))
                last = st
                time.sleep(max(0.0, POLL_S - (time.time() - now)))
        trainer.stop.set()
        trainer.join(timeout=30)
        queue = last.get("queue") or {}
        dropped = float(queue.get("dropped_stale_sequences", 0)) + float(queue.get("refused_stale_sequences", 0))
        out = figures(times, counts, targets, trainer.idle_s, trace.duration_s, dropped, trainer.max_staleness,
                      trainer.steps)
        out["delivered_seqs"] = queue.get("delivered_sequences")
        out["job_id"] = job.job_id
        return out
    finally:
        stop_controller_job(job)


# ---- the report -----------------------------------------------------------------------------
def _fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def report(name: str, real: dict[str, Any] | None, sims: list[dict[str, Any]]) -> str:
    def spread(key: str, digits: int = 0) -> str:
        values = [s[key] for s in sims if s[key] is not None]
        if not values:
            return "-"
        return (f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})")

    rows = [("trainer idle fraction", "idle_fraction", 3), ("GPU-seconds", "gpu_s", 0),
            ("target changes", "target_changes", 0), ("  up", "ups", 0), ("  down", "downs", 0),
            ("first scale-up (s)", "first_up_s", 0), ("trainer steps", "trainer_steps", 0),
            ("sequences dropped or refused stale", "dropped_stale_seqs", 0), ("largest staleness", "max_staleness", 0)]
    lines = [f"### {name}", "", f"| figure | real | sim, {len(sims)} seeds: median (range) |", "|---|---|---|"]
    for label, key, digits in rows:
        lines.append(f"| {label} | {_fmt(real[key] if real else None, digits) if real else '-'} | {spread(key, digits)} |")
    windows = len(sims[0]["workers_per_window"])
    sim_w = [statistics.median(s["workers_per_window"][i] for s in sims) for i in range(windows)]
    real_w = real["workers_per_window"] if real else [float("nan")] * windows
    lines += ["", f"Workers (starting + active + draining), median per {WINDOW_S:.0f} s:", "",
              "| t (s) | " + " | ".join(f"{int(i * WINDOW_S)}" for i in range(windows)) + " |",
              "|---|" + "---|" * windows,
              "| real | " + " | ".join(f"{w:.1f}" for w in real_w) + " |",
              "| sim (median of seeds) | " + " | ".join(f"{w:.1f}" for w in sim_w) + " |", "",
              "Target changes (t s: from -> to):", ""]
    said = ", ".join(f"{t:.0f}: {a}->{b}" for t, a, b in real["changes"]) if real and "changes" in real else "-"
    lines.append(f"- real: {said}")
    for seed, s in enumerate(sims[:3]):
        lines.append(f"- sim seed {seed}: " + ", ".join(f"{t:.0f}: {a}->{b}" for t, a, b in s["changes"]))
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="*", type=Path, default=list(TRACES))
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--sim-only", action="store_true", help="only the simulations (the real runs from --real-json)")
    parser.add_argument("--real-json", type=Path, help="the real runs' figures of an earlier run")
    parser.add_argument("--tmp", type=Path, default=Path("/tmp/se-sim-fidelity"))
    args = parser.parse_args(argv)
    reals: dict[str, Any] = json.loads(args.real_json.read_text()) if args.real_json else {}
    sections = []
    for path in args.traces:
        trace = load_trace(path)
        if not args.sim_only:
            reals[trace.name] = run_real(path, trace, args.tmp / f"{trace.name}-{int(time.time())}")
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            (OUT_DIR / "sim_fidelity.json").write_text(json.dumps(reals, indent=1))
        sims = [run_sim(trace, seed) for seed in range(args.seeds)]
        sections.append(report(trace.name, reals.get(trace.name), sims))
    write_report("sim_fidelity", "## The simulator against the real controller\n\n" + "\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
