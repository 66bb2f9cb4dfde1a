"""The per-node GPU health agent: sample every ``interval_s``, POST the report to the controller.

It survives everything it can: a GPU or field that errors is reported as such, a controller
that is down is retried next interval with exponential backoff, and SIGTERM/SIGINT only set
a flag that the loop checks (it then exits 0).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Literal

import httpx

from slurm_elastic.client.control import KEPT_ALIVE
from slurm_elastic.client.files import read_token_file
from slurm_elastic.client.wire import report_json
from slurm_elastic.core.defaults import AGENT_INTERVAL_S, AGENT_MAX_BACKOFF_S
from slurm_elastic.core.health import AgentReport
from slurm_elastic.errors import ApiError, ConfigError, ControllerUnreachableError, TelemetryError
from slurm_elastic.gpu.injection import InjectionSource
from slurm_elastic.gpu.nvml import NvmlSource
from slurm_elastic.gpu.source import Reading, TelemetrySource

log = logging.getLogger(__name__)

SourceKind = Literal["nvml", "inject", "auto"]
REPORT_PATH = "/agent/report"


def node_name(env: Mapping[str, str] | None = None) -> str:
    """This node's name as Slurm knows it (``SLURMD_NODENAME``), else the short hostname."""
    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


NVIDIA_CONTROL_DEVICE = Path("/dev/nvidiactl")


class AutoSource:
    """NVML when it initialises; on a node without an NVIDIA driver (no /dev/nvidiactl), the
    injection file when one is given; else NVML anyway, which then reports its init error each
    sample (a GPU node whose NVML fails must look unhealthy, never fake-healthy)."""

    def __init__(self, nvml: NvmlSource, inject: InjectionSource | None) -> None:
        self._nvml = nvml
        self._inject = inject
        self._chosen: TelemetrySource | None = None

    @property
    def name(self) -> str:
        return self._chosen.name if self._chosen else "auto"

    def _choose(self) -> TelemetrySource:
        if self._chosen is None:
            try:
                self._nvml.open()
                self._chosen = self._nvml
            except TelemetryError as exc:
                if self._inject is None or NVIDIA_CONTROL_DEVICE.exists():
                    return self._nvml
                log.info("%s; using the fault-injection source", exc)
                self._chosen = self._inject
        return self._chosen

    def sample(self, now_s: float) -> Reading:
        return self._choose().sample(now_s)

    def close(self) -> None:
        self._nvml.close()


def make_source(
    kind: SourceKind,
    node: str,
    inject_file: str | None = None,
    fake_gpus: int | None = None,
) -> TelemetrySource:
    """The telemetry source for ``--source``."""
    if kind == "nvml":
        return NvmlSource(node)
    inject = InjectionSource(node, inject_file, gpus=fake_gpus) if inject_file else None
    if kind == "inject":
        return inject or InjectionSource(node, None, gpus=fake_gpus)
    if kind == "auto":
        return AutoSource(NvmlSource(node), inject)
    raise ConfigError(f"--source: expected nvml, inject or auto, got {kind!r}")


def build_report(source: TelemetrySource, node: str, now_s: float) -> AgentReport:
    """Sample once; never raises (a failing source becomes an error in the report)."""
    try:
        reading = source.sample(now_s)
    except Exception as exc:
        log.exception("telemetry source %s failed", source.name)
        reading = Reading([], [f"source {source.name}: {exc!r}"])
    return AgentReport(node, now_s, source.name, reading.gpus, reading.errors)


class ReportPoster:
    """POSTs reports to ``{controller_url}/agent/report`` with a bearer token read from a file
    (re-read on each post, so the token can be rotated)."""

    def __init__(self, controller_url: str, token_file: str, timeout_s: float = 5.0) -> None:
        self.url = controller_url.rstrip("/") + REPORT_PATH
        self.token_file = Path(token_file)
        self._client = httpx.Client(timeout=timeout_s, limits=KEPT_ALIVE)  # a report every 5 s reuses it

    def token(self) -> str:
        token = read_token_file(self.token_file)
        if not token:
            raise ConfigError(f"--token-file {self.token_file}: missing or empty, and so is its copy")
        return token

    def post(self, report: AgentReport) -> None:
        headers = {"Authorization": f"Bearer {self.token()}"}
        try:
            resp = self._client.post(self.url, json=report_json(report), headers=headers)
        except httpx.HTTPError as exc:
            raise ControllerUnreachableError(f"{self.url}: {exc!r}") from exc
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, resp.text[:200])

    def close(self) -> None:
        self._client.close()


@dataclass
class Agent:
    """The loop. ``clock`` and ``wait`` are seams for tests; ``wait(delay_s)`` returns True
    when the agent should stop (the default waits on the stop flag)."""

    source: TelemetrySource
    poster: ReportPoster
    node: str
    interval_s: float = AGENT_INTERVAL_S
    max_backoff_s: float = AGENT_MAX_BACKOFF_S
    clock: Callable[[], float] = time.time
    wait: Callable[[float], bool] | None = None

    def __post_init__(self) -> None:
        self.stop = threading.Event()
        self.failures = 0

    def run_once(self) -> bool:
        """Sample and post once; True when the controller took the report."""
        report = build_report(self.source, self.node, self.clock())
        try:
            self.poster.post(report)
        except (ControllerUnreachableError, ApiError, ConfigError) as exc:
            self.failures += 1
            log.warning("report not delivered (%d in a row): %s", self.failures, exc)
            return False
        if self.failures:
            log.info("controller reached again after %d failures", self.failures)
        self.failures = 0
        return True

    def next_delay_s(self) -> float:
        """``interval_s`` after a success; doubling per failure in a row, up to the cap."""
        if self.failures == 0:
            return self.interval_s
        return float(min(self.interval_s * 2 ** min(self.failures, 16), self.max_backoff_s))

    def run(self) -> int:
        """Loop until the stop flag is set. Returns the exit code (0)."""
        wait = self.wait or self.stop.wait
        try:
            while not self.stop.is_set():
                try:
                    self.run_once()
                except Exception:  # the agent never dies on one bad round
                    self.failures += 1
                    log.exception("agent round failed")
                if wait(self.next_delay_s()):
                    break
        finally:
            self.source.close()
            self.poster.close()
        log.info("agent stopped")
        return 0

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT set the stop flag (the loop exits at its next check). SIGUSR1 and
        SIGUSR2, the workers' drain signals, reach every step when someone signals the whole job
        (``scancel --signal=USR1 JOB``): an agent has nothing to drain and samples on."""

        def handler(signum: int, _frame: FrameType | None) -> None:
            log.info("signal %d: stopping", signum)
            self.stop.set()

        def drain_signal(signum: int, _frame: FrameType | None) -> None:
            log.info("signal %d: a drain signal; an agent has nothing to drain and samples on", signum)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGUSR1, drain_signal)
        signal.signal(signal.SIGUSR2, drain_signal)
