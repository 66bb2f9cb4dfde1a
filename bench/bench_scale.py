"""How far the controller scales: 8, 64, 256 worker steps on a dev cluster.

    .venv/bin/python bench/bench_scale.py            # as root; 8, 64, 256 workers (~10 minutes)
    .venv/bin/python bench/bench_scale.py --quick    # 8 and 64 workers, shorter windows (~3 minutes)
    .venv/bin/python bench/bench_scale.py --sizes 64,256 --window-s 20   # 192 launched at once, 256 steady
    .venv/bin/python bench/bench_scale.py --sizes 64,256 --sdk           # commands that run the worker SDK

It brings up its own cluster (32 nodes x 8 fake GPUs = 256 GPU slots, ports 21817/21901+, node
prefix "sn") and takes it down afterwards. Workers are the real step wrapper (``slurm-elastic
worker``: registration, heartbeats, drain) around the lightest command that honours a drain (a
shell waiting on ``sleep``), one fake GPU each. For each worker count it scales up, waits until all
are ACTIVE, and measures over a steady window (``--sdk``: the command is a Python process in
the worker SDK, idle, so its heartbeats come on top of the wrapper's, as a real worker's do): the controller process's CPU (median of sub-windows,
since other work shares this machine) and RSS, tick durations, slurmctld RPCs per tick (``sdiag``),
heartbeats handled, and the memory each worker costs on the node. The baseline is the same figure
at 8 workers, in the same run: growth ratios are value at N / value at 8. Launch throughput (workers
launched by one scale-up / time until all are ACTIVE) is compared with Slurm's own floor measured
first in the same run: as many bare ``srun``s of a Python command, all started at once.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import median, write_headline, write_report
from slurm_elastic.controller.base import TICK_WINDOW
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.files import write_json_atomic
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.state import STATE_FORMAT, STATE_VERSION
from slurm_elastic.core.defaults import (
    AGENT_INTERVAL_S,
    HEARTBEAT_INTERVAL_S,
    MAX_HEARTBEATS_PER_S,
    TICK_INTERVAL_S,
)
from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec
from slurm_elastic.errors import ControllerUnreachableError
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.parse import StepInfo
from tests.cluster.controller_harness import (
    ControllerJob,
    start_controller_job,
    stop_controller_job,
    wait_for,
)
from tests.stub_backend import ListedSteps

NODES, GPUS_PER_NODE = 32, 8  # the host has 10 distinct live char devices to stand in for GPUs
TICK_S = TICK_INTERVAL_S  # the product's default; --tick-s 0.5 for a tick four times as often
HEARTBEAT_S = HEARTBEAT_INTERVAL_S  # the product's default; --heartbeat-s for others
# the lightest worker command that still drains cleanly: the wrapper forwards USR1, the shell exits 0
LIGHT_COMMAND = ["/bin/sh", "-c", "trap 'kill $! 2>/dev/null; exit 0' USR1 TERM; sleep infinity & wait"]
# an idle worker in the SDK: its heartbeat thread beats beside the wrapper's; a drain ends it within 2 s
SDK_COMMAND = [sys.executable, "-c", "import time\nfrom slurm_elastic.worker import RolloutWorker\n"
               "with RolloutWorker.from_env() as worker:\n    while not worker.draining:\n        time.sleep(2)"]
OWN_RPC = "REQUEST_STATS_INFO"  # sdiag's own request: not the controller's


@dataclass
class Window:
    """Figures of one steady window at ``workers`` ACTIVE workers."""

    workers: int
    scale_up_s: float
    cpu_pct: float
    rss_mb: float
    threads: int
    ticks: int
    tick_mean_ms: float
    tick_p50_ms: float
    tick_p95_ms: float
    scale_up_tick_max_ms: float  # the longest of the last TICK_WINDOW ticks once every sender was heard
    step_info_rpcs_per_tick: float
    rpcs_per_tick: float
    heartbeats_per_s: float
    heartbeat_interval_s: float  # the one the controller tells its workers
    state_file_kb: float
    squeue_ms: float
    node_mb_per_worker: dict[str, float]


def rpc_totals(slurm: SlurmCli) -> tuple[int, int]:
    counts = slurm.rpc_counts()
    return counts.get("REQUEST_JOB_STEP_INFO", 0), sum(v for k, v in counts.items() if k != OWN_RPC)


def status_or_none(job: ControllerJob) -> dict[str, Any] | None:
    try:
        return job.status()
    except (ControllerUnreachableError, OSError, ValueError):
        return None


def wait_all_active(job: ControllerJob, n: int, timeout_s: float) -> None:
    """Until ``n`` workers are ACTIVE and none is starting; polls once a second (status is O(workers))."""
    def settled() -> bool:
        st = status_or_none(job)
        by = st["workers_by_state"] if st else {}
        return bool(st) and by["ACTIVE"] == n and by["STARTING"] == 0 and by["BACKOFF"] == 0
    deadline = time.monotonic() + timeout_s
    while not settled():
        if time.monotonic() > deadline:
            raise AssertionError(f"{n} workers not ACTIVE after {timeout_s:g} s: {status_or_none(job)}")
        time.sleep(1.0)


def wait_all_beating(job: ControllerJob, senders: int, timeout_s: float) -> None:
    """Until the controller counts ``senders`` heart-beating processes: with SDK workers, each
    command's SDK starts after its wrapper registered (256 interpreters on the host take a while),
    and the steady window starts once they all beat."""
    deadline = time.monotonic() + timeout_s
    while (st := status_or_none(job)) is None or st.get("heartbeat_senders", 0) < senders:
        if time.monotonic() > deadline:
            raise AssertionError(f"{senders} heart-beating processes not heard after {timeout_s:g} s: "
                                 f"{st and st.get('heartbeat_senders')}")
        time.sleep(1.0)


def node_memory_per_worker(job_id: int, n: int, slurm_conf: str) -> dict[str, float]:
    """PSS (MB) per worker on the node, by process kind: srun, slurmstepd, wrapper, command.

    Only this cluster's processes count (their SLURM_CONF): other clusters may run on this host.
    """
    kinds = {"srun (launcher)": 0.0, "slurmstepd": 0.0, "wrapper (Python)": 0.0, "command": 0.0}
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            argv = proc.info["cmdline"] or []
            if not _runs_under(proc.pid, slurm_conf):
                continue
            line = " ".join(argv)
            if proc.info["name"] == "srun" and f"--jobid={job_id}" in line and "--job-name=se-w-" in line:
                kind = "srun (launcher)"
            elif line.startswith(f"slurmstepd: [{job_id}.") and not line.endswith(("batch]", "extern]")):
                kind = "slurmstepd"
            elif "slurm_elastic worker --" in line:
                kind = "wrapper (Python)"
            elif argv in (LIGHT_COMMAND, SDK_COMMAND) or (argv == ["sleep", "infinity"] and _in_worker(proc)):
                kind = "command"
            else:
                continue
            kinds[kind] += proc.memory_full_info().pss / 2**20
        except (psutil.NoSuchProcess, psutil.AccessDenied, IndexError):
            continue
    return {k: v / max(1, n) for k, v in kinds.items()}


def _runs_under(pid: int, slurm_conf: str) -> bool:
    """Whether ``pid``'s environment names ``slurm_conf`` (read raw: slurmstepd rewrites its argv area)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"SLURM_CONF={slurm_conf}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def _in_worker(proc: psutil.Process) -> bool:
    parent = proc.parent()
    return parent is not None and parent.cmdline() == LIGHT_COMMAND


@dataclass(frozen=True)
class Cadence:
    """How often the controller ticks and the workers heart-beat (a larger pool more slowly:
    ``workers.max_heartbeats_per_s``)."""

    tick_s: float
    heartbeat_s: float
    max_heartbeats_per_s: float
    command: list[str]

    @property
    def command_name(self) -> str:
        return "an idle worker SDK process (its heartbeats beside the wrapper's)" if self.command == SDK_COMMAND \
            else "sh + sleep (the wrapper's heartbeats only)"

    @property
    def senders_per_worker(self) -> int:
        """Processes per worker that heart-beat: the wrapper, and the SDK in its command."""
        return 2 if self.command == SDK_COMMAND else 1

    @property
    def report_name(self) -> str:
        return "scale_sdk" if self.command == SDK_COMMAND else "scale"

    @property
    def grace_s(self) -> float:
        return max(120.0, 3 * self.heartbeat_s)


def measure(job: ControllerJob, slurm: SlurmCli, n: int, scale_up_s: float, window_s: float,
            sub_windows: int, scale_up_tick_max_ms: float) -> Window:
    proc = psutil.Process(job.controller_pid())
    st0, rpc0 = job.status(), rpc_totals(slurm)
    cpu_pcts = []
    for _ in range(sub_windows):
        t0, c0 = time.monotonic(), sum(proc.cpu_times()[:2])
        time.sleep(window_s / sub_windows)
        cpu_pcts.append(100 * (sum(proc.cpu_times()[:2]) - c0) / (time.monotonic() - t0))
    st1, rpc1 = job.status(), rpc_totals(slurm)
    squeue_s = []
    for _ in range(5):  # the tick's one Slurm call, timed from here (after the RPC counts are read)
        t0 = time.perf_counter()
        slurm.list_steps(job.job_id)
        squeue_s.append(time.perf_counter() - t0)
    ticks = max(1, st1["ticks"] - st0["ticks"])
    tick0, tick1 = st0["tick_duration_s"], st1["tick_duration_s"]
    return Window(
        workers=n, scale_up_s=scale_up_s, cpu_pct=median(cpu_pcts), rss_mb=proc.memory_info().rss / 2**20,
        threads=proc.num_threads(), ticks=ticks,
        tick_mean_ms=1000 * (tick1["total_s"] - tick0["total_s"]) / ticks,
        tick_p50_ms=1000 * tick1["p50"], tick_p95_ms=1000 * tick1["p95"],
        scale_up_tick_max_ms=scale_up_tick_max_ms,
        step_info_rpcs_per_tick=(rpc1[0] - rpc0[0]) / ticks, rpcs_per_tick=(rpc1[1] - rpc0[1]) / ticks,
        heartbeats_per_s=(st1["heartbeats"] - st0["heartbeats"]) / window_s,
        heartbeat_interval_s=st1["heartbeat_interval_s"],
        state_file_kb=(job.state_dir / "state.json").stat().st_size / 1024, squeue_ms=1000 * median(squeue_s),
        node_mb_per_worker=node_memory_per_worker(job.job_id, n, os.environ["SLURM_CONF"]),
    )


def bare_srun_burst(job_id: int, n: int) -> float:
    """Seconds until ``n`` bare sruns of a Python command, started at once (one GPU each), have all ended."""
    argv = ["srun", f"--jobid={job_id}", "--exact", "--nodes=1", "--ntasks=1", "--gres=gpu:1",
            "--input=none", sys.executable, "-c", "pass"]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for _ in range(n)]
    failed = [p.communicate()[1].decode(errors="replace")[-300:] for p in procs if p.wait() != 0]
    elapsed_s = time.perf_counter() - t0
    if failed:
        raise AssertionError(f"{len(failed)} of {n} bare sruns failed, e.g.: {failed[0]}")
    return elapsed_s


def run_sizes(cluster: DevCluster, tmp: Path, slurm: SlurmCli, sizes: tuple[int, ...], window_s: float,
              settle_s: float, cadence: Cadence) -> tuple[list[Window], float, tuple[int, float]]:
    job = start_controller_job(
        cluster, tmp / "run", nodes=NODES, gpus_per_node=GPUS_PER_NODE, controller={"tick_interval_s": cadence.tick_s},
        # the node agents at the product's default interval (the test harness samples every 0.5 s: 32 agents
        # then send 64 reports a second, which measured the controller at 21 % of a core at 64 workers)
        agent={"interval_s": AGENT_INTERVAL_S},
        workers={"command": cadence.command, "heartbeat_interval_s": cadence.heartbeat_s,
                 "max_heartbeats_per_s": cadence.max_heartbeats_per_s, "heartbeat_grace_s": cadence.grace_s,
                 "start_timeout_s": 300.0, "drain_timeout_s": 60.0},
    )
    windows = []
    try:
        burst = sizes[-1] - (sizes[-2] if len(sizes) > 1 else 0)  # the largest single scale-up
        floor = (burst, bare_srun_burst(job.job_id, burst))
        print(f"floor: {burst} bare sruns at once ended after {floor[1]:.1f} s ({burst / floor[1]:.1f}/s)", flush=True)
        current = 0
        for n in sizes:
            t0 = time.perf_counter()
            with job.client() as client:
                client.scale(n)
            wait_all_active(job, n, timeout_s=600)
            scale_up_s = time.perf_counter() - t0
            print(f"{n} workers ACTIVE after {scale_up_s:.1f} s (from {current})", flush=True)
            wait_all_beating(job, n * cadence.senders_per_worker, timeout_s=600)
            print(f"all {n * cadence.senders_per_worker} senders heard after {time.perf_counter() - t0:.1f} s",
                  flush=True)
            busiest_ms = 1000 * job.status()["tick_duration_s"]["max"]  # the ticks of the scale-up, most of them
            current = n
            time.sleep(settle_s)
            windows.append(measure(job, slurm, n, scale_up_s, window_s, sub_windows=5, scale_up_tick_max_ms=busiest_ms))
            print(windows[-1], flush=True)
        t0 = time.perf_counter()
        with job.client() as client:
            client.scale(0)
        wait_for(lambda: not job.worker_steps(), 600, "every worker step to end")
        drain_s = time.perf_counter() - t0
    finally:
        stop_controller_job(job)
    return windows, drain_s, floor


def steady_controller(n: int, state_dir: Path) -> Controller:
    """A controller with ``n`` registered, listed, ACTIVE workers on NODES x GPUS_PER_NODE GPUs."""
    backend = ListedSteps()
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    controller = Controller(config, 1, backend, state_dir,  # type: ignore[arg-type]
                            gpus_by_node={f"x{i}": tuple(range(GPUS_PER_NODE)) for i in range(NODES)})
    controller.scale(n)
    controller.tick()
    for i, worker_id in enumerate(sorted(controller.workers)):
        node, gpu = f"x{i // GPUS_PER_NODE}", i % GPUS_PER_NODE
        backend.steps.append(StepInfo(1, str(i), worker_step_name(worker_id), (node,), "1:00", "", "gres/gpu:1", 1))
        controller.register_worker(worker_id, {"node": node, "gpus": [gpu], "step_id": str(i)})
    controller.tick()
    return controller


def per_tick_ms(action: Any, repeats: int = 40) -> float:
    """Median wall time of ``action()`` in ms."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        action()
        times.append(time.perf_counter() - t0)
    return 1000 * median(times)


def persistence_rows(sizes: tuple[int, ...]) -> list[str]:
    """Per-tick work in process (no Slurm call) before and after the state-file fix, same state."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        for n in sizes:
            controller = steady_controller(n, Path(tmp_name) / str(n))
            path = controller.state_file.path

            def before(c: Controller = controller, p: Path = path) -> None:  # every tick: indented, pure-Python encoder
                write_json_atomic(p, {"format": STATE_FORMAT, "version": STATE_VERSION, "job_id": c.job_id,
                                      "saved_at": time.time(), "state": c._state()})

            def changed(c: Controller = controller) -> None:  # a durable change: one compact write
                c.state_file.save(c._state())

            def heartbeat_and_tick(c: Controller = controller, w: str = min(controller.workers)) -> None:
                c.heartbeat(w, {"busy": True})
                c.tick()
            rows.append(f"| {n} | {per_tick_ms(before):.2f} ms | {per_tick_ms(changed):.2f} ms | "
                        f"{per_tick_ms(controller.save):.2f} ms | {per_tick_ms(heartbeat_and_tick):.2f} ms |")
    return ["### State file per tick, in process (same controller state; medians of 40)", "",
            "| workers | before: indented write every tick | after: compact write (a durable change) | "
            "after: steady pool (no write) | whole tick after (listing given, no Slurm call) |",
            "|---|---|---|---|---|", *rows, ""]


def report(windows: list[Window], drain_s: float, window_s: float, floor: tuple[int, float], cadence: Cadence) -> str:
    base = windows[0]
    cols = [f"{w.workers} workers" for w in windows]
    prev = [0, *[w.workers for w in windows[:-1]]]

    def row(name: str, values: list[str], growth: str = "") -> str:
        return f"| {name} | " + " | ".join(values) + f" | {growth} |"

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.1f}x" if b else "n/a"

    last = windows[-1]
    rss_per_worker_kb = 1024 * (last.rss_mb - base.rss_mb) / max(1, last.workers - base.workers)
    lines = [
        f"## Controller scale (dev cluster: {NODES} nodes x {GPUS_PER_NODE} fake GPUs, Slurm 22.05, 2 shared cores)",
        "",
        f"Worker command: {cadence.command_name}. Tick interval {cadence.tick_s:g} s, heartbeat interval {cadence.heartbeat_s:g} s (a pool beats at most "
        f"{cadence.max_heartbeats_per_s:g} times a second together), agent interval {AGENT_INTERVAL_S:g} s, steady window {window_s:g} s per size "
        f"(CPU: median of 5 sub-windows). Growth: value at the largest size / value at {base.workers} workers.",
        "",
        "| figure | " + " | ".join(cols) + f" | growth {base.workers} -> {last.workers} |",
        "|---|" + "---|" * (len(windows) + 1),
        row("time to all ACTIVE (from the previous size)",
            [f"{w.scale_up_s:.1f} s ({w.workers - p} launched, {(w.workers - p) / w.scale_up_s:.1f}/s)"
             for w, p in zip(windows, prev, strict=True)]),
        row("controller CPU, % of one core", [f"{w.cpu_pct:.1f}" for w in windows], ratio(last.cpu_pct, base.cpu_pct)),
        row("controller RSS", [f"{w.rss_mb:.0f} MB" for w in windows],
            f"{ratio(last.rss_mb, base.rss_mb)} ({rss_per_worker_kb:.0f} kB per added worker)"),
        row("controller threads", [str(w.threads) for w in windows], ratio(last.threads, base.threads)),
        row("tick duration, mean over the window", [f"{w.tick_mean_ms:.1f} ms" for w in windows],
            ratio(last.tick_mean_ms, base.tick_mean_ms)),
        row(f"tick duration p50 / p95 (the last {TICK_WINDOW} ticks, all steady)", [f"{w.tick_p50_ms:.1f} / {w.tick_p95_ms:.1f} ms" for w in windows],
            ratio(last.tick_p50_ms, base.tick_p50_ms)),
        row(f"longest tick while scaling up (of the last {TICK_WINDOW} once every sender was heard)",
            [f"{w.scale_up_tick_max_ms:.0f} ms" for w in windows]),
        row("the tick's one listing (squeue --steps), p50", [f"{w.squeue_ms:.0f} ms" for w in windows],
            ratio(last.squeue_ms, base.squeue_ms)),
        row("slurmctld RPCs per tick: step listings / all", [f"{w.step_info_rpcs_per_tick:.2f} / {w.rpcs_per_tick:.2f}"
                                                             for w in windows],
            ratio(last.rpcs_per_tick, base.rpcs_per_tick)),
        row(f"heartbeats handled per s (expected: {cadence.senders_per_worker} per worker / the interval it is told)",
            [f"{w.heartbeats_per_s:.1f} ({cadence.senders_per_worker * w.workers / w.heartbeat_interval_s:.1f}: "
             f"every {w.heartbeat_interval_s:g} s)" for w in windows],
            ratio(last.heartbeats_per_s, base.heartbeats_per_s)),
        row("state file size (written on a durable change)", [f"{w.state_file_kb:.0f} kB" for w in windows],
            ratio(last.state_file_kb, base.state_file_kb)),
    ]
    for kind in base.node_mb_per_worker:
        lines.append(row(f"per worker on the node: {kind}, PSS",
                         [f"{w.node_mb_per_worker[kind]:.1f} MB" for w in windows]))
    lines.append(row("per worker on the node: total PSS",
                     [f"{sum(w.node_mb_per_worker.values()):.1f} MB" for w in windows]))
    lines += ["", f"Launch throughput: {last.workers - prev[-1]} workers by one scale-up, "
              f"{(last.workers - prev[-1]) / last.scale_up_s:.1f}/s until all ACTIVE; Slurm's floor in the same run, "
              f"{floor[0]} bare sruns of a Python command started at once: {floor[0] / floor[1]:.1f}/s until all ended",
              "", f"Drain of all {last.workers} workers (scale to 0 -> no worker step left): {drain_s:.1f} s", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 and 64 workers, shorter windows")
    parser.add_argument("--sizes", default="", help="worker counts in order, e.g. 64,256 (default: 8,64,256)")
    parser.add_argument("--window-s", type=float, default=0.0, help="steady window (and settle time) per size")
    parser.add_argument("--tick-s", type=float, default=TICK_S, help="the controller's tick interval (default: the product's)")
    parser.add_argument("--heartbeat-s", type=float, default=HEARTBEAT_S, help="the workers' heartbeat interval (default: the product's)")
    parser.add_argument("--sdk", action="store_true", help="workers run an idle SDK process (not sh + sleep)")
    parser.add_argument("--max-heartbeats-per-s", type=float, default=MAX_HEARTBEATS_PER_S,
                        help="workers.max_heartbeats_per_s (default: the product's; 1e5: no pacing)")
    args = parser.parse_args()
    sizes: tuple[int, ...] = (8, 64) if args.quick else (8, 64, 256)
    window_s = settle_s = 15.0 if args.quick else 30.0
    if args.sizes:
        sizes = tuple(int(n) for n in args.sizes.split(","))
    if args.window_s:
        window_s = settle_s = args.window_s
    settle_s = max(settle_s, TICK_WINDOW * args.tick_s - window_s)  # the tick p95 read from steady ticks only
    cadence = Cadence(args.tick_s, args.heartbeat_s, args.max_heartbeats_per_s, SDK_COMMAND if args.sdk else LIGHT_COMMAND)
    spec = DevClusterSpec(dir=Path(tempfile.gettempdir()) / "se-scale-cluster", nodes=NODES,
                          gpus_per_node=GPUS_PER_NODE, cpus_per_node=16, memory_per_node_mb=8000,
                          ctld_port=21817, node_base_port=21901, cluster_name="scale", node_prefix="sn")
    cluster = DevCluster(spec)
    cluster.up(wait_s=180)
    os.environ["SLURM_CONF"] = str(cluster.conf_path)
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            windows, drain_s, floor = run_sizes(cluster, Path(tmp_name), SlurmCli(), sizes, window_s, settle_s, cadence)
    finally:
        cluster.down()
    write_report(cadence.report_name, "\n".join([report(windows, drain_s, window_s, floor, cadence), *persistence_rows((8, 64, 256))]))
    base, last = windows[0], windows[-1]
    launched = last.workers - (windows[-2].workers if len(windows) > 1 else 0)
    write_headline(cadence.report_name, [
        (f"launch throughput, {launched} workers by one scale-up until all registered (vs {floor[0]} bare sruns "
         "of a Python command at once)", f"{launched / last.scale_up_s:.1f}/s", f"{floor[0] / floor[1]:.1f}/s",
         f"{launched / last.scale_up_s / (floor[0] / floor[1]):.2f}x"),
        (f"controller at {last.workers} workers, tick {cadence.tick_s:g} s, heartbeats every "
         f"{last.heartbeat_interval_s:g} s (at most {cadence.max_heartbeats_per_s:g}/s): "
         "CPU (% of a core) / RSS / tick p50",
         f"{last.cpu_pct:.1f} % / {last.rss_mb:.0f} MB / {last.tick_p50_ms:.0f} ms",
         f"at {base.workers}: {base.cpu_pct:.1f} % / {base.rss_mb:.0f} MB / {base.tick_p50_ms:.0f} ms",
         f"{last.workers / base.workers:.0f}x workers: CPU {last.cpu_pct / max(base.cpu_pct, 1e-9):.1f}x, "
         f"RSS {last.rss_mb / base.rss_mb:.1f}x"),
        (f"slurmctld step-listing RPCs per tick at {last.workers} workers (sdiag)",
         f"{last.step_info_rpcs_per_tick:.2f}", f"one call per worker: {last.workers}",
         f"{last.step_info_rpcs_per_tick / last.workers:.3f}x"),
    ])


if __name__ == "__main__":
    main()
