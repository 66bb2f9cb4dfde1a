"""Run the real controller in a real allocation on the dev cluster, as a batch script would."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_elastic.client.control import ControlClient
from slurm_elastic.devcluster.cluster import DevCluster
from slurm_elastic.errors import ControllerUnreachableError
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.runner import run_command

FAKE_WORKER = Path(__file__).with_name("fake_worker.py")
REPO = Path(__file__).resolve().parents[2]


def wait_for(predicate: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


@dataclass
class ControllerJob:
    """A batch job whose script runs the controller in a restart loop."""

    job_id: int
    tmp: Path
    cluster: DevCluster

    @property
    def state_dir(self) -> Path:
        return self.tmp / f"state-{self.job_id}"

    def client(self) -> ControlClient:
        handle = locate_in(self.state_dir, self.job_id)
        return ControlClient(handle[0], handle[1])

    def status(self) -> dict[str, Any]:
        with self.client() as c:
            return c.status()

    def events(self) -> list[dict[str, Any]]:
        path = self.tmp / "events.log"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def controller_pid(self) -> int:
        return int(json.loads((self.state_dir / "controller.json").read_text())["pid"])

    def worker_steps(self) -> dict[str, str]:
        """worker step name -> step id, as Slurm lists them."""
        return {s.name: s.step_id for s in SlurmCli().list_steps(self.job_id) if s.name.startswith("se-w-")}

    def active(self, n: int, timeout_s: float = 40.0) -> dict[str, Any]:
        """Wait until exactly ``n`` real workers are ACTIVE and nothing is starting or draining."""
        last: dict[str, Any] = {}

        def settled() -> dict[str, Any] | None:
            try:
                st = self.status()
            except ControllerUnreachableError:
                return None
            by = st["workers_by_state"]
            last.update(by=by, errors=st["errors"][-3:], placeholders=st["placeholders"])
            real_active = by["ACTIVE"]  # placeholders are counted apart
            ok = real_active == n and by["STARTING"] == 0 and by["DRAINING"] == 0 and by["BACKOFF"] == 0
            return st if ok else None
        try:
            return wait_for(settled, timeout_s, f"{n} active workers")  # type: ignore[no-any-return]
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last status: {last}") from None


def locate_in(state_dir: Path, job_id: int) -> tuple[str, str]:
    info = json.loads((state_dir / "controller.json").read_text())
    return str(info["url"]), (state_dir / "token").read_text().strip()


def start_controller_job(cluster: DevCluster, tmp: Path, *, workers: dict[str, Any] | None = None,
                         agent: dict[str, Any] | None = None, health: dict[str, Any] | None = None,
                         worker_env: dict[str, str] | None = None, autoscaler: dict[str, Any] | None = None,
                         queue: dict[str, Any] | None = None,
                         controller: dict[str, Any] | None = None,
                         weights: dict[str, Any] | None = None,
                         burst: dict[str, Any] | None = None,
                         nodes: int = 2,
                         gpus_per_node: int = 4,
                         before_start: Callable[[int], None] | None = None,
                         sbatch_options: tuple[str, ...] = ()) -> ControllerJob:
    """Submit a job (default: 2 nodes, all 8 fake GPUs) running the controller; wait until it answers.

    ``before_start(job_id)`` runs while the job is held, before it can start; ``sbatch_options`` are
    added to sbatch's."""
    w = {"command": [sys.executable, str(FAKE_WORKER)], "initial_workers": 0, "heartbeat_interval_s": 0.3,
         "heartbeat_grace_s": 8.0, "drain_timeout_s": 8.0, "start_timeout_s": 30.0, "backoff_base_s": 1.0,
         "backoff_max_s": 8.0, **(workers or {})}
    env = {"FAKE_WORKER_LOG": str(tmp / "events.log"), "FAKE_GPU_DIR": str(cluster.dir / "dev"),
           "ROLLOUT_S": "0.5", **(worker_env or {})}
    config = {
        "controller": {"tick_interval_s": 0.3, "state_dir": str(tmp / "state-{job_id}"), **(controller or {})},
        "workers": {**w, "env": env},
        # the node agents on, as by default (the fault-injection source: there is no NVIDIA driver here);
        # agents off: no agent key but that (the others would be read by nothing, and are refused)
        "agent": {"enabled": True, "source": "inject", "interval_s": 0.5, "inject_file": str(tmp / "drill.toml"),
                  **(agent or {})} if (agent or {}).get("enabled", True) else dict(agent or {}),
        "health": health or {},
        "autoscaler": {"min_workers": 0, **(autoscaler or {})},
        "queue": queue or {},
        "weights": weights or {},
        **({"burst": burst} if burst else {}),
    }
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "elastic.toml").write_text(_toml(config))
    script = tmp / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"export PYTHONPATH={REPO}${{PYTHONPATH:+:$PYTHONPATH}}\n"
        f"until [ -e {tmp}/stop ]; do {sys.executable} -m slurm_elastic controller --config {tmp}/elastic.toml"
        " && break; sleep 0.3; done\n"
    )
    tmp.mkdir(parents=True, exist_ok=True)
    hold = ["--hold"] if before_start else []
    out = run_command(["sbatch", "--parsable", *hold, f"--nodes={nodes}", "--exclusive", f"--gres=gpu:{gpus_per_node}",
                       "--mem=0", "--job-name=se-ctl-test", f"--output={tmp}/job.out", f"--chdir={tmp}",
                       *sbatch_options,  # the job's working directory: Slurm writes a shrunk job's resize scripts there
                       str(script)]).stdout
    job = ControllerJob(int(out.strip().split(";")[0]), tmp, cluster)
    if before_start:
        before_start(job.job_id)
        run_command(["scontrol", "release", str(job.job_id)])

    def answers() -> bool:
        try:
            job.status()
            return True
        except (ControllerUnreachableError, OSError, ValueError):
            return False
    try:
        wait_for(answers, 60, "the controller to answer")
    except AssertionError:
        stop_controller_job(job)
        raise AssertionError(f"controller did not come up; job output:\n{_tail(tmp / 'job.out')}") from None
    return job


def _tail(path: Path) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-20:])
    except OSError:
        return "(no output)"


def burst_options(cluster: DevCluster, max_jobs: int = 1, **more: Any) -> dict[str, Any]:
    """``[burst]`` for a test: 4-GPU burst jobs in the preemptible partition, submitted without
    a cooldown, given back 60 s after the controller stops answering, no signal lead; ``more``
    overrides (a key set to None: the controller's default)."""
    options = {"max_jobs": max_jobs, "gpus_per_job": 4, "partition": cluster.spec.preempt_partition,
               "submit_cooldown_s": 0, "controller_unreachable_grace_s": 60, "signal_lead_s": 0, **more}
    return {key: value for key, value in options.items() if value is not None}


def stop_controller_job(job: ControllerJob) -> None:
    (job.tmp / "stop").touch()
    run_command(["scancel", str(job.job_id)], check=False)
    wait_for(lambda: not run_command(["squeue", "-h", "-j", str(job.job_id)], check=False).stdout.strip(),
             60, "job to end")


def restart_slurmctld(cluster: DevCluster) -> None:
    """Stop slurmctld and start it again (its state is kept): after a node was set DOWN under a job,
    Slurm 22.05 keeps whole-node jobs pending ("Resources") for minutes after that job ends; a
    restarted slurmctld schedules them at once."""
    pid = cluster.daemon_pid("slurmctld")
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: cluster.daemon_pid("slurmctld") is None, 30, "slurmctld to stop")
    cluster.up(wait_s=90)


def _toml(data: dict[str, Any]) -> str:
    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, dict):
                inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
                lines.append(f"{key} = {{ {inner} }}")
            else:
                lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


