"""What a worker step knows about itself: from the environment the controller and Slurm set."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slurm_elastic.client.files import read_token_and_file, token_file_source
from slurm_elastic.core.defaults import (
    HEARTBEAT_INTERVAL_S,
    LIVENESS_INTERVAL_S,
    LIVENESS_TIMEOUT_S,
    START_TIMEOUT_S,
)
from slurm_elastic.core.limits import MAX_DURATION_S, MAX_REPEATS
from slurm_elastic.core.signals import DEFAULT_DRAIN_SIGNAL, drain_signal_name, drain_signal_number
from slurm_elastic.errors import ConfigError
from slurm_elastic.host_address import reachable_address

# the worker's step (JOB.STEP), set by its wrapper for the command: an srun inside the command starts a
# step of its own and SLURM_STEP_ID there names that one, while the SDK's counts belong to the worker's
WORKER_STEP_ENV = "SLURM_ELASTIC_STEP"


@dataclass(frozen=True)
class StepContext:
    """Identity and settings of this worker step."""

    worker_id: str
    controller_url: str
    token: str
    heartbeat_interval_s: float
    drain_signal: str
    node: str
    gpus: tuple[int, ...]
    step_id: str
    job_id: str
    state_dir: Path | None = None
    kind: str = "rollout"
    readiness_path: str = ""
    start_timeout_s: float = START_TIMEOUT_S
    liveness_path: str = ""
    liveness_interval_s: float = LIVENESS_INTERVAL_S
    liveness_timeout_s: float = LIVENESS_TIMEOUT_S
    liveness_failure_threshold: int = 0  # 0: no liveness probes
    rank: int = 0  # the task's rank in its step (SLURM_PROCID); only rank 0 registers as the worker
    term_drains: bool = False  # a step of a burst job: its first SIGTERM (preemption) is a drain
    token_source: str = ""  # where the token came from, said when the controller refuses it

    @property
    def drain_signum(self) -> signal.Signals:
        return drain_signal_number(self.drain_signal)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StepContext:
        env = os.environ if env is None else env
        missing = [k for k in ("SLURM_ELASTIC_WORKER_ID", "SLURM_ELASTIC_CONTROLLER_URL") if not env.get(k)]
        if missing:
            raise ConfigError(f"not started by a slurm-elastic controller: {', '.join(missing)} not set")
        token = env.get("SLURM_ELASTIC_TOKEN", "")
        token_file = env.get("SLURM_ELASTIC_TOKEN_FILE", "")
        source = "SLURM_ELASTIC_TOKEN"
        if not token and token_file:
            token, read = read_token_and_file(Path(token_file))
            if not token:
                raise ConfigError(f"the job's token file {token_file} is missing or empty, and so is its copy")
            source = token_file_source(f"SLURM_ELASTIC_TOKEN_FILE ({token_file})", Path(token_file), read)
        if not token:
            raise ConfigError("no token for the controller: set SLURM_ELASTIC_TOKEN_FILE (the controller sets it "
                              "for the steps it launches) or SLURM_ELASTIC_TOKEN")
        gpus = tuple(int(g) for g in env.get("SLURM_STEP_GPUS", "").split(",") if g.strip().isdigit())
        worker_step = _worker_step(env.get(WORKER_STEP_ENV, ""))
        kind = env.get("SLURM_ELASTIC_WORKER_KIND", "rollout")
        if kind not in ("rollout", "server"):
            raise ConfigError(f"SLURM_ELASTIC_WORKER_KIND: {kind!r} is not rollout or server")
        return cls(
            worker_id=env["SLURM_ELASTIC_WORKER_ID"],
            controller_url=env["SLURM_ELASTIC_CONTROLLER_URL"].rstrip("/"),
            token=token,
            heartbeat_interval_s=_seconds(env, "SLURM_ELASTIC_HEARTBEAT_INTERVAL_S", HEARTBEAT_INTERVAL_S),
            drain_signal=drain_signal_name(env.get("SLURM_ELASTIC_DRAIN_SIGNAL", DEFAULT_DRAIN_SIGNAL)),
            node=env.get("SLURMD_NODENAME") or socket.gethostname(),
            gpus=gpus,
            job_id=worker_step[0] if worker_step else env.get("SLURM_JOB_ID", ""),
            step_id=worker_step[1] if worker_step else env.get("SLURM_STEP_ID", ""),
            state_dir=Path(env["SLURM_ELASTIC_STATE_DIR"]) if env.get("SLURM_ELASTIC_STATE_DIR") else None,
            kind=kind,
            readiness_path=env.get("SLURM_ELASTIC_READINESS_PATH", ""),
            start_timeout_s=_seconds(env, "SLURM_ELASTIC_START_TIMEOUT_S", START_TIMEOUT_S),
            liveness_path=env.get("SLURM_ELASTIC_LIVENESS_PATH", ""),
            liveness_interval_s=_seconds(env, "SLURM_ELASTIC_LIVENESS_INTERVAL_S", LIVENESS_INTERVAL_S),
            liveness_timeout_s=_seconds(env, "SLURM_ELASTIC_LIVENESS_TIMEOUT_S", LIVENESS_TIMEOUT_S),
            liveness_failure_threshold=_whole(env, "SLURM_ELASTIC_LIVENESS_FAILURE_THRESHOLD", 0, MAX_REPEATS),
            rank=_whole(env, "SLURM_PROCID", 0, 65535),
            term_drains=env.get("SLURM_ELASTIC_TERM_DRAINS", "") == "1",
            token_source=source,
        )

    def registration(self) -> dict[str, object]:
        info: dict[str, object] = {"node": self.node, "gpus": list(self.gpus), "step_id": self.step_id,
                                   "pid": os.getpid(), "ready": self.kind != "server"}
        if self.rank:
            info["rank"] = self.rank
        return info


def _worker_step(text: str) -> tuple[str, str] | None:
    """``JOB.STEP`` of the worker's step as its wrapper passed it (``WORKER_STEP_ENV``), or None
    where unset or not that shape."""
    job_id, _, step_id = text.partition(".")
    return (job_id, step_id) if job_id.isdigit() and step_id.isdigit() else None


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    """A duration the controller passes in the environment: finite, above 0, at most a year."""
    text = env.get(name, "")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name}: {text!r} is not a number of seconds") from None
    if not 0 < value <= MAX_DURATION_S:  # NaN fails too
        raise ConfigError(f"{name}: {text!r} is not a number of seconds above 0 and at most {MAX_DURATION_S:.0f}")
    return value


def _whole(env: Mapping[str, str], name: str, default: int, largest: int) -> int:
    """A count in the environment: ASCII digits, at most ``largest``."""
    text = env.get(name, "")
    if not text:
        return default
    if not (text.isascii() and text.isdigit()) or int(text) > largest:
        raise ConfigError(f"{name}: {text!r} is not a whole number from 0 to {largest}")
    return int(text)


def node_address() -> str:
    """This node's address as other nodes reach it (not loopback where an interface has another)."""
    return reachable_address()[0]
