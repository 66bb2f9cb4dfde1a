"""The fault-injection telemetry source: fake GPUs whose readings an operator file overrides.

The file (TOML, or JSON when it ends in ``.json``) is re-read on every sample, so editing it
starts or ends a drill without restarting anything. The format is documented for operators
in docs/gpu-health.md. A missing file means all-healthy fake GPUs.

``from = "now"`` is pinned to the first time this source reads that fault entry (an edited
entry is a new fault); ``until`` (absolute) or ``duration_s`` (from ``from``) end it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from slurm_elastic.core.health import CLOCK_EVENT_FLAGS, GpuSample
from slurm_elastic.errors import TelemetryError
from slurm_elastic.gpu.nvml import slurm_indices
from slurm_elastic.gpu.source import Reading

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger(__name__)

_BASELINE_KEYS = {
    "gpus": int,
    "memory_total_mb": int,
    "memory_used_mb": int,
    "temperature_c": float,
    "power_w": float,
    "utilization_pct": float,
}
_FAULT_VALUE_KEYS = {
    "temperature_c": float,
    "memory_used_mb": int,
    "memory_total_mb": int,
    "utilization_pct": float,
    "power_w": float,
    "ecc_uncorrectable_volatile": int,
    "ecc_uncorrectable_aggregate": int,
    "retired_pages_pending": bool,
    "remapped_rows_pending": bool,
    "remapped_rows_failure": bool,
    "lost": bool,
}
_FAULT_KEYS = {"node", "gpu", "reasons", "from", "until", "duration_s", "note", *_FAULT_VALUE_KEYS}


@dataclass
class Fault:
    """One parsed ``[[fault]]`` entry (times resolved to epoch seconds)."""

    node: str
    gpu: int | None
    from_s: float
    until_s: float | None
    reasons: frozenset[str] = frozenset()
    values: dict[str, Any] = field(default_factory=dict)

    def active(self, node: str, gpu: int, now_s: float) -> bool:
        if self.node not in ("*", node) or (self.gpu is not None and self.gpu != gpu):
            return False
        return self.from_s <= now_s and (self.until_s is None or now_s < self.until_s)


@dataclass
class InjectionConfig:
    baseline: dict[str, Any]
    gpus_per_node: dict[str, int]
    faults: list[Fault]


def default_gpu_count(env: Mapping[str, str]) -> int:
    """GPUs on this node from Slurm's environment (1 when nothing says)."""
    n = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if n.isdigit():
        return int(n)
    for var in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "GPU_DEVICE_ORDINAL"):
        ids = [p for p in env.get(var, "").split(",") if p.strip()]
        if ids:
            return len(ids)
    return 1


def fake_uuid(node: str, index: int) -> str:
    """A stable UUID-shaped id for a fake GPU."""
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"slurm-elastic-fake-gpu:{node}:{index}"))


class InjectionSource:
    """Fake GPUs for ``node`` with readings from ``path`` (re-read on each sample)."""

    name = "inject"

    def __init__(
        self,
        node: str,
        path: str | os.PathLike[str] | None,
        gpus: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.node = node
        self.path = Path(path) if path is not None else None
        self._env = env if env is not None else os.environ
        self._gpus = gpus
        self._pinned_now: dict[str, float] = {}
        self._last_good: InjectionConfig | None = None

    def close(self) -> None:
        pass

    def load(self, now_s: float) -> InjectionConfig:
        """Read and parse the file; raises ``TelemetryError`` naming the bad entry."""
        if self.path is None or not self.path.exists():
            return InjectionConfig({}, {}, [])
        try:
            text = self.path.read_text()
            raw = json.loads(text) if self.path.suffix == ".json" else tomllib.loads(text)
        except (OSError, ValueError) as exc:
            raise TelemetryError(f"inject file {self.path}: {exc}") from exc
        return self._parse(raw, now_s)

    def sample(self, now_s: float) -> Reading:
        errors: list[str] = []
        try:
            cfg = self.load(now_s)
            self._last_good = cfg
        except TelemetryError as exc:
            if self._last_good is None:  # healthy readings now would lift the drill's cordons
                return Reading([], [f"{exc} (no good version read yet: no readings until it parses)"])
            errors.append(f"{exc} (using the last good version)")
            cfg = self._last_good
        base = cfg.baseline
        count = cfg.gpus_per_node.get(self.node)
        if count is None:
            count = base.get("gpus", self._gpus)
        if count is None:
            count = default_gpu_count(self._env)
        indices, _ = slurm_indices(count, self._env)
        gpus = [self._gpu(index, cfg, now_s) for index in indices]
        return Reading(gpus, errors)

    def _gpu(self, index: int, cfg: InjectionConfig, now_s: float) -> GpuSample:
        base = cfg.baseline
        values: dict[str, Any] = {
            "temperature_c": base.get("temperature_c", 40.0),
            "memory_total_mb": base.get("memory_total_mb", 81920),
            "memory_used_mb": base.get("memory_used_mb", 0),
            "utilization_pct": base.get("utilization_pct", 0.0),
            "power_w": base.get("power_w", 70.0),
            "ecc_uncorrectable_volatile": 0,
            "ecc_uncorrectable_aggregate": 0,
            "retired_pages_pending": False,
            "remapped_rows_pending": False,
            "remapped_rows_failure": False,
            "lost": False,
        }
        reasons: set[str] = set()
        for fault in cfg.faults:
            if fault.active(self.node, index, now_s):
                reasons |= fault.reasons
                values.update(fault.values)
        return GpuSample(
            self.node,
            index,
            uuid=fake_uuid(self.node, index),
            clock_event_reasons=frozenset(reasons),
            **values,
        )

    # ---- parsing

    def _parse(self, raw: Any, now_s: float) -> InjectionConfig:
        where = f"inject file {self.path}"
        if not isinstance(raw, dict):
            raise TelemetryError(f"{where}: expected a table at the top")
        unknown = set(raw) - {"baseline", "fault"}
        if unknown:
            raise TelemetryError(f"{where}: unknown key {sorted(unknown)[0]!r}")
        baseline_raw = raw.get("baseline", {})
        if not isinstance(baseline_raw, dict):
            raise TelemetryError(f"{where}: 'baseline' must be a table")
        baseline: dict[str, Any] = {}
        per_node: dict[str, int] = {}
        for key, value in baseline_raw.items():
            name = f"{where}: baseline.{key}"
            if key == "gpus_per_node":
                if not isinstance(value, dict):
                    raise TelemetryError(f"{name}: expected a table of node = count")
                for node, n in value.items():
                    per_node[node] = _typed(f"{name}.{node}", n, int)
            elif key in _BASELINE_KEYS:
                baseline[key] = _typed(name, value, _BASELINE_KEYS[key])
            else:
                raise TelemetryError(f"{name}: unknown key")
        faults_raw = raw.get("fault", [])
        if not isinstance(faults_raw, list):
            raise TelemetryError(f"{where}: 'fault' must be an array of tables ([[fault]])")
        faults = [self._fault(f"{where}: fault[{i}]", f, now_s) for i, f in enumerate(faults_raw)]
        return InjectionConfig(baseline, per_node, faults)

    def _fault(self, where: str, raw: Any, now_s: float) -> Fault:
        if not isinstance(raw, dict):
            raise TelemetryError(f"{where}: expected a table")
        unknown = set(raw) - _FAULT_KEYS
        if unknown:
            raise TelemetryError(f"{where}.{sorted(unknown)[0]}: unknown key")
        node = raw.get("node")
        if not isinstance(node, str) or not node:
            raise TelemetryError(f"{where}.node: expected a node name or '*'")
        gpu = raw.get("gpu")
        if gpu is not None:
            gpu = _typed(f"{where}.gpu", gpu, int)
        reasons = raw.get("reasons", [])
        if not isinstance(reasons, list) or not all(r in CLOCK_EVENT_FLAGS for r in reasons):
            raise TelemetryError(
                f"{where}.reasons: expected a list of {', '.join(CLOCK_EVENT_FLAGS)}"
            )
        identity = json.dumps(raw, sort_keys=True, default=str)
        from_s = self._time(f"{where}.from", raw.get("from", "now"), identity, now_s)
        until_s = None
        if "until" in raw:
            until_s = self._time(f"{where}.until", raw["until"], identity, now_s)
        if "duration_s" in raw:
            until_s = from_s + _typed(f"{where}.duration_s", raw["duration_s"], float)
        values = {
            k: _typed(f"{where}.{k}", raw[k], t) for k, t in _FAULT_VALUE_KEYS.items() if k in raw
        }
        return Fault(node, gpu, from_s, until_s, frozenset(reasons), values)

    def _time(self, where: str, value: Any, identity: str, now_s: float) -> float:
        if value == "now":
            return self._pinned_now.setdefault(identity, now_s)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, datetime):  # TOML offset date-time
            dt = value
        elif isinstance(value, str):
            try:
                dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                raise TelemetryError(
                    f"{where}: expected 'now', epoch seconds or an ISO 8601 time, got {value!r}"
                ) from None
        else:
            raise TelemetryError(f"{where}: expected 'now', epoch seconds or an ISO 8601 time")
        return dt.timestamp()  # a time without an offset is local time


def _typed(where: str, value: Any, kind: type) -> Any:
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise TelemetryError(f"{where}: expected {kind.__name__}, got {value!r}")
    return float(value) if kind is float else value
