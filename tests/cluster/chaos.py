"""The chaos soak: a real controller job under steady rollout load with a trainer pulling, while a
seeded schedule kill -9s the controller (mid scale-up, mid drain, between batch hand-out and ack),
kills workers, restarts a ``slurmd`` and injects GPU faults; then the invariants are checked from
evidence the controller does not write (the workers' own logs, the trainer's record, ``squeue``,
the process table).

    result = run_chaos(cluster, tmp, ChaosSettings(seed=7, duration_s=60))
    print(result.summary())        # chaos: controller kills survived 6, ..., violations 0

The invariant checks are pure functions (unit-tested without a cluster).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from slurm_elastic.client.control import ControlClient
from slurm_elastic.devcluster.cluster import DevCluster
from slurm_elastic.errors import ControllerUnreachableError, SlurmElasticError
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.runner import run_command
from slurm_elastic.trainer import Trainer
from tests.cluster.controller_harness import (
    ControllerJob,
    locate_in,
    start_controller_job,
    stop_controller_job,
    wait_for,
)

CHAOS_WORKER = Path(__file__).with_name("chaos_worker.py")
FAULT_KINDS = ("kill_controller_scale_up", "kill_controller_drain", "kill_controller_handout",
               "kill_controller_recovery", "kill_worker", "restart_slurmd", "gpu_fault")


@dataclass(frozen=True)
class ChaosSettings:
    """One soak: the seed fixes the fault schedule, its delays and its victims."""

    seed: int = 7
    duration_s: float = 0.0  # 0: ``rounds`` rounds of faults, then stop
    rounds: int = 2  # a round: every fault kind once, shuffled, plus ``extra_faults`` drawn at random
    extra_faults: int = 2
    min_workers: int = 2
    max_workers: int = 6
    final_workers: int = 4
    batch_size: int = 8
    group_size: int = 2
    rollout_s: float = 0.3
    gap_s: tuple[float, float] = (0.0, 2.5)  # pause between faults (0: two at once)
    kill_delay_s: tuple[float, float] = (0.0, 1.0)  # scale/drain order -> kill -9
    gpu_fault_hold_s: tuple[float, float] = (2.0, 5.0)
    slurmd_down_s: tuple[float, float] = (0.2, 4.0)
    placement_slack_s: float = 2.0  # a worker process born this long after a cordon (or before its lift) was placed in it
    baseline_s: float = 0.0  # fault-free load first (at ``min_workers``), for the throughput ratio
    settle_timeout_s: float = 180.0  # generous waits: they bound a hang, they do not grade speed


@dataclass(frozen=True)
class Fault:
    kind: str
    at_index: int


def fault_schedule(rng: random.Random, extra: int) -> Iterator[Fault]:
    """Every kind once in a shuffled round first, then ``extra`` more drawn at random; rounds repeat."""
    index = 0
    while True:
        round_kinds = list(FAULT_KINDS)
        rng.shuffle(round_kinds)
        round_kinds += [rng.choice(FAULT_KINDS) for _ in range(extra)]
        for kind in round_kinds:
            yield Fault(kind, index)
            index += 1


# ---- evidence ------------------------------------------------------------------------------------
@dataclass
class WorkerLog:
    """What the workers wrote themselves."""

    starts: list[dict[str, Any]] = field(default_factory=list)
    submitted: set[str] = field(default_factory=set)  # sent (maybe stored, maybe not: killed mid-send)
    acked: set[str] = field(default_factory=set)  # the controller answered 2xx: it must be delivered
    drained_pids: set[int] = field(default_factory=set)  # processes that finished a drain and exited


def read_worker_logs(log_dir: Path) -> WorkerLog:
    out = WorkerLog()
    for path in sorted(log_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a line cut short by kill -9
            if e["event"] == "start":
                out.starts.append(e)
            elif e["event"] == "submit":
                out.submitted.add(e["id"])
            elif e["event"] == "acked":
                out.acked.add(e["id"])
            elif e["event"] == "drained":
                out.drained_pids.add(int(e["pid"]))
    return out


@dataclass
class CordonSpan:
    """A cordon as status showed it: placed at ``since_s`` (controller clock = wall clock on this host),
    last seen still in force at ``last_seen_s``."""

    node: str
    gpu: int
    source: str
    since_s: float
    last_seen_s: float


def exactly_once_violations(acked: set[str], submitted: set[str], delivered: list[str]) -> list[str]:
    """Every acknowledged id delivered once; nothing delivered twice; nothing delivered that no one sent."""
    counts = Counter(delivered)
    problems = [f"rollout {gid} delivered {n} times" for gid, n in sorted(counts.items()) if n > 1]
    problems += [f"rollout {gid} acknowledged (2xx) but never delivered" for gid in sorted(acked - counts.keys())]
    problems += [f"rollout {gid} delivered but never sent" for gid in sorted(counts.keys() - submitted - acked)]
    return problems


def cordon_violations(starts: Iterable[dict[str, Any]], spans: Iterable[CordonSpan], slack_s: float) -> list[str]:
    """A worker process born on a GPU well after it was cordoned and well before the cordon was
    last seen was placed there. ``slack_s`` on both sides: a process's birth time (psutil's
    create_time) is off by up to a second, as Linux gives the boot time in whole seconds."""
    problems = []
    span_list = list(spans)
    for s in starts:
        born = float(s["proc_start_t"])
        for span in span_list:
            if (s["node"] == span.node and span.gpu in s["gpus"]
                    and span.since_s + slack_s < born < span.last_seen_s - slack_s):
                problems.append(f"worker {s['worker']} (pid {s['pid']}) started on cordoned {span.node}:{span.gpu} "
                                f"{born - span.since_s:.1f} s after the {span.source} cordon")
    return problems


def duplicate_step_violations(samples: Iterable[tuple[float, list[str]]]) -> list[str]:
    """Never two live steps (or worker processes) for one worker id at the same moment."""
    problems = []
    for at_s, names in samples:
        for name, n in Counter(names).items():
            if n > 1:
                problems.append(f"{n} live {name} at {at_s:.1f}")
    return sorted(set(problems))


@dataclass(frozen=True)
class LiveWorker:
    proc: psutil.Process
    worker_id: str
    node: str

    @property
    def pid(self) -> int:
        return int(self.proc.pid)


def scan_processes(attrs: list[str]) -> list[tuple[psutil.Process, dict[str, Any]]]:
    """Every process with ``attrs`` read now. Fresh objects: ``psutil.process_iter`` shares one cache
    (and its ``info``) between threads."""
    found = []
    for pid in psutil.pids():
        try:
            proc = psutil.Process(pid)
            found.append((proc, proc.as_dict(attrs)))
        except psutil.Error:
            continue
    return found


def live_worker_processes(log_dir: Path) -> list[LiveWorker]:
    """This soak's chaos worker processes still alive (``python chaos_worker.py LOG_DIR``; not the
    wrapper or ``srun`` whose command lines hold the same words)."""
    wanted = [str(CHAOS_WORKER), str(log_dir)]
    found = []
    for proc, info in scan_processes(["cmdline", "status"]):
        if info["status"] != psutil.STATUS_ZOMBIE and (info["cmdline"] or [])[1:] == wanted:
            try:
                env = proc.environ()
            except psutil.Error:
                continue  # gone meanwhile
            found.append(LiveWorker(proc, env.get("SLURM_ELASTIC_WORKER_ID", ""), env.get("SLURMD_NODENAME", "")))
    return found


# ---- the load: a trainer that records every delivered id ------------------------------------------
class RecordingTrainer(threading.Thread):
    """Pulls and acknowledges batches with the trainer helper; records the group ids of every batch it
    processed. ``hold_next_batch()`` makes it stop between a hand-out and its ack (for a kill)."""

    def __init__(self, job: ControllerJob) -> None:
        super().__init__(name="chaos-trainer", daemon=True)
        url, token = locate_in(job.state_dir, job.job_id)
        self.trainer = Trainer(url, token, state_dir=job.state_dir, poll_s=0.05)
        self.delivered: list[str] = []
        self.batches = 0
        self.stop = threading.Event()
        self._want_hold = threading.Event()
        self.holding = threading.Event()
        self._release = threading.Event()
        self.error: BaseException | None = None

    def hold_next_batch(self) -> None:
        self._release.clear()
        self.holding.clear()
        self._want_hold.set()

    def release(self) -> None:
        self._want_hold.clear()
        self._release.set()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                batch = self.trainer.next_batch(timeout_s=0.5)
                if batch is None:
                    continue
                if self._want_hold.is_set():
                    self.holding.set()
                    self._release.wait(120)
                self.trainer.ack(batch)
                self.delivered.extend(str(g["id"]) for g in batch.groups)
                self.batches += 1
        except BaseException as exc:  # reported as a violation, not lost in a thread
            self.error = exc
        finally:
            self.trainer.close()


# ---- the observer: status and squeue, sampled ------------------------------------------------------
class Monitor(threading.Thread):
    """Samples cordons (status), live worker steps (squeue) and live worker processes (process table)."""

    def __init__(self, job: ControllerJob, log_dir: Path, interval_s: float = 0.5) -> None:
        super().__init__(name="chaos-monitor", daemon=True)
        self.job, self.log_dir, self.interval_s = job, log_dir, interval_s
        self.spans: dict[tuple[str, int, float], CordonSpan] = {}
        self.step_samples: list[tuple[float, list[str]]] = []
        self.process_samples: list[tuple[float, list[str]]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._slurm = SlurmCli()

    def run(self) -> None:
        try:
            while not self.stop.wait(self.interval_s):
                self.sample()
        except BaseException as exc:  # a blind checker must fail the soak, not pass it
            self.error = exc

    def sample(self) -> None:
        now = time.time()
        with contextlib.suppress(ControllerUnreachableError, OSError, ValueError, KeyError):
            for g in self.job.status()["cordoned_gpus"]:
                key = (g["node"], int(g["gpu"]), float(g["since_s"]))
                span = self.spans.setdefault(key, CordonSpan(g["node"], int(g["gpu"]), g["source"], key[2], now))
                span.last_seen_s = now
        with contextlib.suppress(SlurmElasticError):
            steps = [s.name for s in self._slurm.list_steps(self.job.job_id) if s.name.startswith("se-w-")]
            self.step_samples.append((now, steps))
        ids = [w.worker_id for w in live_worker_processes(self.log_dir)]
        self.process_samples.append((now, [f"process of worker {w}" for w in ids if w]))


# ---- the result --------------------------------------------------------------------------------------
@dataclass
class ChaosResult:
    seed: int
    counts: Counter[str] = field(default_factory=Counter)
    rollouts_checked: int = 0
    batches: int = 0
    duration_s: float = 0.0
    baseline: tuple[float, float] = (0.0, 0.0)  # (rollouts/s, mean live workers) without faults
    chaos: tuple[float, float] = (0.0, 0.0)  # the same under the fault schedule
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        c = self.counts
        return (f"chaos: controller kills survived {c['controller_kills']} "
                f"(scale-up {c['kill_controller_scale_up']}, drain {c['kill_controller_drain']}, "
                f"hand-out {c['kill_controller_handout']}, start-up {c['kill_controller_recovery']}), worker kills {c['kill_worker']}, "
                f"slurmd restarts {c['restart_slurmd']}, GPU faults {c['gpu_fault']}, "
                f"rollouts checked {self.rollouts_checked}, violations {len(self.violations)}")

    def details(self) -> str:
        c = self.counts
        return (f"seed {self.seed}, {self.duration_s:.0f} s, {self.batches} batches acknowledged, "
                f"{c['worker_starts']} worker starts ({c['starts_under_a_cordon']} on a node with a GPU cordoned), "
                f"{c['cordons_seen']} cordons seen, "
                f"{c['workers_kept_across_slurmd_restart']} of {c['workers_across_slurmd_restart']} workers on a "
                f"restarted slurmd's node kept running; " + "; ".join(self.notes))


# ---- the soak -----------------------------------------------------------------------------------------
class ChaosRun:
    def __init__(self, cluster: DevCluster, tmp: Path, settings: ChaosSettings) -> None:
        self.cluster, self.tmp, self.s = cluster, tmp, settings
        self.rng = random.Random(settings.seed)
        self.log_dir = tmp / "worker-logs"
        self.result = ChaosResult(settings.seed)
        self.drill_faults: dict[tuple[str, int], float] = {}  # (node, gpu) -> clear at (monotonic)
        self.target = settings.min_workers
        self.killed_pids: set[int] = set()  # worker processes (and wrappers) this soak kill -9'ed
        self.slurmd_restarts: list[tuple[float, str]] = []  # (wall time, node)

    # -- set-up and tear-down
    def start(self) -> ControllerJob:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return start_controller_job(
            self.cluster, self.tmp,
            workers={"command": [sys.executable, str(CHAOS_WORKER), str(self.log_dir)],
                     "heartbeat_interval_s": 1.0, "heartbeat_grace_s": 20.0, "drain_timeout_s": 15.0,
                     "start_timeout_s": 60.0, "backoff_base_s": 0.5, "backoff_max_s": 4.0},
            worker_env={"CHAOS_GROUP_SIZE": str(self.s.group_size), "CHAOS_ROLLOUT_S": str(self.s.rollout_s)},
            agent={"enabled": True, "source": "inject", "interval_s": 0.5},
            health={"healthy_period_s": 2.0, "agent_silence_s": 20.0, "crash_threshold": 1000},
            queue={"batch_size": self.s.batch_size, "capacity_seqs": 400},
            nodes=self.cluster.spec.nodes, gpus_per_node=self.cluster.spec.gpus_per_node,
        )

    def run(self) -> ChaosResult:
        began = time.monotonic()
        job = self.start()
        trainer: RecordingTrainer | None = None
        monitor = Monitor(job, self.log_dir)
        try:
            trainer = RecordingTrainer(job)
            trainer.start()
            monitor.start()
            with job.client() as c:
                c.scale(self.target)
            job.active(self.target, timeout_s=self.s.settle_timeout_s)
            if self.s.baseline_s > 0:
                self.result.baseline = self.rate(trainer, monitor, lambda: time.sleep(self.s.baseline_s))
            self.result.chaos = self.rate(trainer, monitor, lambda: self.inject(job, trainer))
            self.converge(job)
            self.flush(job, trainer)
        except AssertionError as exc:  # a wait that ran out (the controller never came back, ...)
            self.result.violations.append(f"soak stopped early: {exc}")
        finally:
            monitor.stop.set()
            if trainer is not None:
                trainer.stop.set()
                trainer.release()
                trainer.join(timeout=60)
            self.clear_drill()
            stop_controller_job(job)
            monitor.join(timeout=30)
        self.check_after_stop(job)
        self.check(monitor, trainer)
        self.result.duration_s = time.monotonic() - began
        return self.result

    @staticmethod
    def rate(trainer: RecordingTrainer, monitor: Monitor, phase: Callable[[], None]) -> tuple[float, float]:
        """Rollouts delivered per second while ``phase`` runs, and the mean number of live workers."""
        before, t0 = len(trainer.delivered), time.time()
        phase()
        t1 = time.time()
        live = [len(names) for at_s, names in list(monitor.process_samples) if t0 <= at_s <= t1]
        return (len(trainer.delivered) - before) / max(1e-9, t1 - t0), sum(live) / max(1, len(live))

    # -- faults
    def inject(self, job: ControllerJob, trainer: RecordingTrainer) -> None:
        s = self.s
        deadline = time.monotonic() + s.duration_s
        total = (len(FAULT_KINDS) + s.extra_faults) * s.rounds
        for fault in fault_schedule(self.rng, s.extra_faults):
            if (s.duration_s <= 0 and fault.at_index >= total) or (s.duration_s > 0 and time.monotonic() > deadline):
                break
            time.sleep(self.rng.uniform(*s.gap_s))
            self.clear_due_drill_faults(job)
            getattr(self, fault.kind)(job, trainer)
            self.result.counts[fault.kind] += 1
        self.clear_drill()

    def kill_controller(self, job: ControllerJob) -> None:
        pid = job.controller_pid()
        os.kill(pid, signal.SIGKILL)
        self.wait_new_controller(job, pid)
        self.result.counts["controller_kills"] += 1

    def wait_new_controller(self, job: ControllerJob, pid: int) -> None:
        """Until a controller other than ``pid`` answers."""
        def new_one_answers() -> bool:
            try:
                if job.controller_pid() == pid:
                    return False
                job.status()
                return True
            except (ControllerUnreachableError, OSError, ValueError, KeyError):
                return False
        wait_for(new_one_answers, self.s.settle_timeout_s, "a new controller after kill -9")

    def controller_processes(self) -> list[psutil.Process]:
        """The job's controller processes (the batch script's loop starts one after another)."""
        config = str(self.tmp / "elastic.toml")
        found = []
        for proc, info in scan_processes(["cmdline", "status"]):
            cmdline = info["cmdline"] or []
            if info["status"] != psutil.STATUS_ZOMBIE and "controller" in cmdline and config in cmdline:
                found.append(proc)
        return found

    def kill_controller_recovery(self, job: ControllerJob, _trainer: RecordingTrainer) -> None:
        """A scale order, kill -9, and kill -9 again while the next controller is still starting up
        (reading its state, adopting steps, its first ticks)."""
        self.target = self.rng.randint(self.s.min_workers, self.s.max_workers)
        with job.client() as c:
            c.scale(self.target)
        time.sleep(self.rng.uniform(*self.s.kill_delay_s))
        old = {p.pid for p in self.controller_processes()}
        for proc in self.controller_processes():
            proc.send_signal(signal.SIGKILL)
        successor = wait_for(lambda: [p for p in self.controller_processes() if p.pid not in old],
                             self.s.settle_timeout_s, "the next controller process")[0]
        time.sleep(self.rng.uniform(0.0, 2.0))
        with contextlib.suppress(psutil.NoSuchProcess):
            successor.send_signal(signal.SIGKILL)
        self.wait_new_controller(job, successor.pid)
        self.result.counts["controller_kills"] += 2

    def kill_controller_scale_up(self, job: ControllerJob, _trainer: RecordingTrainer) -> None:
        if self.target >= self.s.max_workers:  # room to grow: come down first, settle, then go up
            self.target = self.s.min_workers
            with job.client() as c:
                c.scale(self.target)
            job.active(self.target, timeout_s=self.s.settle_timeout_s)
        self.target = self.rng.randint(self.target + 1, self.s.max_workers)
        with job.client() as c:
            c.scale(self.target)
        time.sleep(self.rng.uniform(*self.s.kill_delay_s))
        self.kill_controller(job)

    def kill_controller_drain(self, job: ControllerJob, _trainer: RecordingTrainer) -> None:
        if self.target <= self.s.min_workers:  # something to drain: go up first, settle, then down
            self.target = self.s.max_workers
            with job.client() as c:
                c.scale(self.target)
            job.active(self.target, timeout_s=self.s.settle_timeout_s)
        self.target = self.rng.randint(max(0, self.s.min_workers - 1), self.target - 1)
        with job.client() as c:
            c.scale(self.target)
        time.sleep(self.rng.uniform(*self.s.kill_delay_s))
        self.kill_controller(job)

    def kill_controller_handout(self, job: ControllerJob, trainer: RecordingTrainer) -> None:
        trainer.hold_next_batch()
        try:
            wait_for(trainer.holding.is_set, self.s.settle_timeout_s, "a batch handed out, not yet acknowledged")
            time.sleep(self.rng.uniform(0.0, 0.3))
            self.kill_controller(job)
        finally:
            trainer.release()

    def kill_worker(self, job: ControllerJob, _trainer: RecordingTrainer) -> None:
        """kill -9 a live worker process, or (half the time) the step's wrapper above it."""
        def candidates() -> list[LiveWorker]:
            return live_worker_processes(self.log_dir)
        victims = wait_for(candidates, self.s.settle_timeout_s, "a live worker to kill")
        victim: psutil.Process = self.rng.choice(sorted(victims, key=lambda w: w.pid)).proc
        self.killed_pids.add(victim.pid)  # the worker process dies with its wrapper's step too
        if self.rng.random() < 0.5:
            with contextlib.suppress(psutil.Error):
                parent = victim.parent()
                if parent is not None and "worker" in " ".join(parent.cmdline()):
                    victim = parent
        self.killed_pids.add(victim.pid)
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.send_signal(signal.SIGKILL)

    def restart_slurmd(self, job: ControllerJob, _trainer: RecordingTrainer) -> None:
        """kill -9 one node's slurmd and start it again: its job steps (slurmstepd) keep running."""
        node = self.rng.choice(self.cluster.spec.node_names())
        daemon = f"slurmd-{node}"
        pid = self.cluster.daemon_pid(daemon)
        if pid is None:
            raise AssertionError(f"{daemon} is not running")
        on_node = {w.pid for w in live_worker_processes(self.log_dir) if w.node == node}
        self.slurmd_restarts.append((time.time(), node))
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                 30, f"{daemon} to die")
        if self.rng.random() < 0.5 and self.target < self.s.max_workers:  # launches while a slurmd is down
            self.target = self.s.max_workers
            with job.client() as c:
                c.scale(self.target)
        if self.rng.random() < 0.3:  # and the controller dies while that slurmd is away
            self.kill_controller(job)
        time.sleep(self.rng.uniform(*self.s.slurmd_down_s))
        run_command(["slurmd", "-N", node], env=self.cluster.env(), timeout_s=30)
        wait_for(lambda: self.cluster.daemon_pid(daemon) is not None, 30, f"{daemon} to start again")
        wait_for(lambda: not self.cluster.node_states().get(node, "*").endswith("*"), self.s.settle_timeout_s,
                 f"{node} to respond again")
        alive = {p.pid for p in live_worker_processes(self.log_dir)} | read_worker_logs(self.log_dir).drained_pids
        self.result.counts["workers_across_slurmd_restart"] += len(on_node)
        self.result.counts["workers_kept_across_slurmd_restart"] += len(on_node & alive)

    def gpu_fault(self, job: ControllerJob, _trainer: RecordingTrainer) -> None:
        """A thermal fault on a random GPU through the drill file; cleared a few seconds later."""
        free = [(n, g) for n in self.cluster.spec.node_names() for g in range(self.cluster.spec.gpus_per_node)
                if (n, g) not in self.drill_faults]
        node, gpu = self.rng.choice(free)
        self.drill_faults[(node, gpu)] = time.monotonic() + self.rng.uniform(*self.s.gpu_fault_hold_s)
        self.write_drill()

        def cordoned() -> bool:
            with contextlib.suppress(ControllerUnreachableError, OSError, ValueError, KeyError):
                return any((g["node"], g["gpu"]) == (node, gpu) for g in job.status()["cordoned_gpus"])
            return False
        wait_for(cordoned, self.s.settle_timeout_s, f"{node}:{gpu} cordoned after the injected fault")
        if self.rng.random() < 0.5:  # every GPU wanted: placement must step around the cordoned one
            self.target = self.cluster.spec.nodes * self.cluster.spec.gpus_per_node
            with job.client() as c:
                c.scale(self.target)

    def write_drill(self) -> None:
        text = "".join(f'[[fault]]\nnode = "{n}"\ngpu = {g}\nreasons = ["hw_thermal_slowdown"]\n'
                       f"temperature_c = 95\n\n" for n, g in sorted(self.drill_faults))
        tmp = self.tmp / "drill.toml.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.tmp / "drill.toml")

    def clear_due_drill_faults(self, job: ControllerJob) -> None:
        now = time.monotonic()
        due = [k for k, at in self.drill_faults.items() if at <= now]
        for key in due:
            del self.drill_faults[key]
        if due:
            self.write_drill()

    def clear_drill(self) -> None:
        self.drill_faults.clear()
        (self.tmp / "drill.toml").unlink(missing_ok=True)

    # -- after the faults
    def converge(self, job: ControllerJob) -> None:
        """Faults over: every cordon lifts and the worker count reaches the final target."""
        self.target = self.s.final_workers
        wait_for(lambda: not job.status()["cordoned_gpus"], self.s.settle_timeout_s, "every cordon lifted")
        with job.client() as c:
            c.scale(self.target)
        try:
            status = job.active(self.target, timeout_s=self.s.settle_timeout_s)
        except AssertionError as exc:
            self.result.violations.append(f"worker count did not converge to {self.target}: {exc}")
            return
        active = sorted(f"se-w-{w['worker_id']}" for w in status["workers"]
                        if w["state"] == "ACTIVE" and not w["placeholder"])

        expected = sorted([*active, *(f"se-agent-{n}" for n in self.cluster.spec.node_names())])

        def all_steps() -> list[str]:
            return sorted(s.name for s in SlurmCli().list_steps(job.job_id) if s.name not in ("batch", "extern"))
        try:  # every step accounted for: one per active worker, one agent per node, nothing else
            wait_for(lambda: all_steps() == expected, 30, "squeue's steps to match the active workers and agents")
        except AssertionError:
            self.result.violations.append(f"squeue lists steps {all_steps()}, expected {expected}")

        def processes_match() -> bool:
            return len(live_worker_processes(self.log_dir)) == self.target
        try:
            wait_for(processes_match, 30, "one worker process per active worker")
        except AssertionError:
            self.result.violations.append(
                f"{len(live_worker_processes(self.log_dir))} worker processes alive for {self.target} workers")

    def flush(self, job: ControllerJob, trainer: RecordingTrainer) -> None:
        """Drain every worker (their last groups go in), top the queue up to whole batches, let the trainer
        take everything."""
        with job.client() as c:
            c.scale(0)
        job.active(0, timeout_s=self.s.settle_timeout_s)
        wait_for(lambda: not live_worker_processes(self.log_dir), 60, "drained workers to exit")
        url, token = locate_in(job.state_dir, job.job_id)
        fillers = 0
        with ControlClient(url, token) as c:
            queued = int(c.global_status()["queue_size"])
            while queued % self.s.batch_size:
                fillers += 1
                gid = f"filler-{fillers}"
                c.submit_group({"id": gid, "worker_id": "filler", "policy_version": 0, "group_size": self.s.group_size,
                                "sequences": [{"tokens": [1], "score": 0.0}] * self.s.group_size})
                with (self.log_dir / "filler.jsonl").open("a") as f:
                    f.write(json.dumps({"event": "acked", "id": gid}) + "\n")
                queued += self.s.group_size
            wait_for(lambda: int(c.global_status()["queue_size"]) == 0, self.s.settle_timeout_s,
                     "the trainer to take every queued rollout")

    def check_after_stop(self, job: ControllerJob) -> None:
        """No step of the job left, no worker process left, every node idle again."""
        def no_steps() -> bool:
            out = run_command(["squeue", "-h", "-s", "-j", str(job.job_id)], check=False).stdout
            return not out.strip()
        try:
            wait_for(no_steps, 60, "the job's steps to end")
        except AssertionError:
            self.result.violations.append(f"steps left after the job ended: {job.job_id}")
        try:
            wait_for(lambda: not live_worker_processes(self.log_dir), 60, "worker processes to end")
        except AssertionError:
            leftovers = [p.pid for p in live_worker_processes(self.log_dir)]
            self.result.violations.append(f"orphaned worker processes after the job: {leftovers}")
            for worker in live_worker_processes(self.log_dir):
                with contextlib.suppress(psutil.Error):
                    worker.proc.kill()

        def idle() -> bool:
            states = self.cluster.node_states()
            return all(states.get(n) == "idle" for n in self.cluster.spec.node_names())
        try:
            wait_for(idle, self.s.settle_timeout_s, "every node idle")
        except AssertionError:
            self.result.violations.append(f"nodes not idle after the soak: {self.cluster.node_states()}")

    def check(self, monitor: Monitor, trainer: RecordingTrainer | None) -> None:
        logs = read_worker_logs(self.log_dir)
        delivered = trainer.delivered if trainer else []
        if monitor.error is not None:
            self.result.violations.append(f"monitor failed (checks incomplete): {monitor.error!r}")
        if trainer is not None and trainer.error is not None:
            self.result.violations.append(f"trainer failed: {trainer.error!r}")
        self.result.violations += exactly_once_violations(logs.acked, logs.submitted, delivered)
        self.result.violations += cordon_violations(logs.starts, monitor.spans.values(), self.s.placement_slack_s)
        self.result.violations += duplicate_step_violations(monitor.step_samples)
        self.result.violations += duplicate_step_violations(monitor.process_samples)
        self.result.rollouts_checked = len(logs.acked)
        self.result.batches = trainer.batches if trainer else 0
        self.result.counts["worker_starts"] = len(logs.starts)
        self.result.counts["cordons_seen"] = len(monitor.spans)
        self.result.counts["starts_under_a_cordon"] = sum(  # chances the cordon check had to fail
            1 for st in logs.starts
            if any(sp.node == st["node"] and sp.since_s < st["proc_start_t"] < sp.last_seen_s
                   for sp in monitor.spans.values()))
        unexplained = [st for st in logs.starts if st["pid"] not in logs.drained_pids | self.killed_pids]
        self.result.counts["unexplained_worker_exits"] = len(unexplained)
        for st in unexplained:  # not drained, not killed by the soak: the controller ended it (or Slurm)
            restarts = [f"{node} at +{at - st['t']:.1f} s" for at, node in self.slurmd_restarts
                        if node == st["node"] and at > st["t"]]
            self.result.notes.append(f"worker {st['worker']} pid {st['pid']} on {st['node']} ended neither drained "
                                     f"nor killed by the soak (slurmd restarts on its node after its start: "
                                     f"{', '.join(restarts[:3]) or 'none'})")
        self.result.notes.append(f"{len(logs.submitted - logs.acked)} sends cut short by a kill "
                                 f"({len(set(delivered) & (logs.submitted - logs.acked))} of them stored and delivered)")


def run_chaos(cluster: DevCluster, tmp: Path, settings: ChaosSettings) -> ChaosResult:
    return ChaosRun(cluster, tmp, settings).run()
