"""GPU health: samples, rules and the cordon book (pure; time comes in as ``now_s``).

A GPU is named ``(node, gpu)`` where ``gpu`` is the index as Slurm numbers it on that node.
Memory is in MiB (``_mb``), temperature in degrees Celsius, power in watts.

The flow: the per-node agent reports :class:`GpuSample` lists, :func:`evaluate` turns one
sample into cordon reasons under :class:`HealthRules`, and :class:`CordonBook` keeps the
cordon state per GPU with hysteresis, operator cordons, crash cordons and pre-flight cordons.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from slurm_elastic.errors import ConfigError

GpuKey = tuple[str, int]
"""``(node, gpu index as Slurm numbers it)``."""

CordonSource = Literal["health", "prolog", "crash", "operator", "preflight"]

CLOCK_EVENT_FLAGS: tuple[str, ...] = (
    "idle",
    "applications_clocks",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake",
    "display_clock",
    "board_limit",
    "reliability",
)
"""Our names for NVML clock event (throttle) reasons, in NVML bit order (0x1 .. 0x400).
Bits we do not know are reported as ``unknown_0x...``."""

DEFAULT_CORDON_CLOCK_EVENTS: frozenset[str] = frozenset(
    {"hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake", "reliability"}
)
"""Clock events that mean a fault. ``sw_power_cap`` (a GPU at its normal power limit under
load), ``idle``, ``applications_clocks``, ``sync_boost``, ``display_clock`` and
``board_limit`` are normal operation and never cordon by default."""

_SOURCE_PRECEDENCE: tuple[CordonSource, ...] = ("operator", "health", "prolog", "crash", "preflight")
_WATCHED: tuple[CordonSource, ...] = ("health", "prolog")  # lifted by the healthy period of the agent's samples


# --------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU. ``None`` means "could not read"; ``errors`` says why."""

    node: str
    index: int
    uuid: str = ""
    temperature_c: float | None = None
    clock_event_reasons: frozenset[str] | None = None
    memory_used_mb: int | None = None
    memory_total_mb: int | None = None
    utilization_pct: float | None = None
    power_w: float | None = None
    ecc_uncorrectable_volatile: int | None = None
    ecc_uncorrectable_aggregate: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    lost: bool = False
    errors: list[str] = field(default_factory=list)
    pci_bus_id: str | None = None

    @property
    def key(self) -> GpuKey:
        return (self.node, self.index)

    @property
    def memory_free_mb(self) -> int | None:
        if self.memory_used_mb is None or self.memory_total_mb is None:
            return None
        return self.memory_total_mb - self.memory_used_mb

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (reasons sorted, so reports are stable)."""
        return {
            "node": self.node,
            "index": self.index,
            "uuid": self.uuid,
            "pci_bus_id": self.pci_bus_id,
            "temperature_c": self.temperature_c,
            "clock_event_reasons": (
                None if self.clock_event_reasons is None else sorted(self.clock_event_reasons)
            ),
            "memory_used_mb": self.memory_used_mb,
            "memory_total_mb": self.memory_total_mb,
            "utilization_pct": self.utilization_pct,
            "power_w": self.power_w,
            "ecc_uncorrectable_volatile": self.ecc_uncorrectable_volatile,
            "ecc_uncorrectable_aggregate": self.ecc_uncorrectable_aggregate,
            "retired_pages_pending": self.retired_pages_pending,
            "remapped_rows_pending": self.remapped_rows_pending,
            "remapped_rows_failure": self.remapped_rows_failure,
            "lost": self.lost,
            "errors": list(self.errors),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GpuSample:
        """Parse :meth:`to_dict` output; raises ``ValueError`` naming the bad field."""
        if not isinstance(d, Mapping):
            raise ValueError("gpu sample: expected an object")
        unknown = set(d) - _SAMPLE_FIELDS
        if unknown:
            raise ValueError(f"gpu sample: unknown field {sorted(unknown)[0]!r}")
        try:
            node = d["node"]
            index = d["index"]
        except KeyError as exc:
            raise ValueError(f"gpu sample: missing field {exc.args[0]!r}") from None
        if not isinstance(node, str) or not node:
            raise ValueError("gpu sample: 'node' must be a non-empty string")
        if not _is_int(index) or index < 0:
            raise ValueError("gpu sample: 'index' must be an integer >= 0")
        reasons_raw = d.get("clock_event_reasons")
        reasons: frozenset[str] | None = None
        if reasons_raw is not None:
            if not isinstance(reasons_raw, list) or not all(
                isinstance(r, str) for r in reasons_raw
            ):
                raise ValueError("gpu sample: 'clock_event_reasons' must be a list of strings")
            reasons = frozenset(reasons_raw)
        errors = d.get("errors", [])
        if not isinstance(errors, list) or not all(isinstance(e, str) for e in errors):
            raise ValueError("gpu sample: 'errors' must be a list of strings")
        uuid = d.get("uuid", "")
        if not isinstance(uuid, str):
            raise ValueError("gpu sample: 'uuid' must be a string")
        pci = d.get("pci_bus_id")
        if pci is not None and not isinstance(pci, str):
            raise ValueError("gpu sample: 'pci_bus_id' must be a string or null")
        lost = d.get("lost", False)
        if not isinstance(lost, bool):
            raise ValueError("gpu sample: 'lost' must be a boolean")
        return cls(
            node=node,
            index=int(index),
            uuid=uuid,
            pci_bus_id=pci,
            temperature_c=_opt_num(d, "temperature_c"),
            clock_event_reasons=reasons,
            memory_used_mb=_opt_int(d, "memory_used_mb"),
            memory_total_mb=_opt_int(d, "memory_total_mb"),
            utilization_pct=_opt_num(d, "utilization_pct"),
            power_w=_opt_num(d, "power_w"),
            ecc_uncorrectable_volatile=_opt_int(d, "ecc_uncorrectable_volatile"),
            ecc_uncorrectable_aggregate=_opt_int(d, "ecc_uncorrectable_aggregate"),
            retired_pages_pending=_opt_bool(d, "retired_pages_pending"),
            remapped_rows_pending=_opt_bool(d, "remapped_rows_pending"),
            remapped_rows_failure=_opt_bool(d, "remapped_rows_failure"),
            lost=lost,
            errors=list(errors),
        )


_SAMPLE_FIELDS = frozenset(GpuSample.__dataclass_fields__)


@dataclass(frozen=True)
class AgentReport:
    """What one node agent posts: ``{node, sampled_at_s, source, gpus: [...], errors}``."""

    node: str
    sampled_at_s: float
    source: str
    gpus: list[GpuSample]
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "sampled_at_s": self.sampled_at_s,
            "source": self.source,
            "gpus": [g.to_dict() for g in self.gpus],
            "errors": list(self.errors),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AgentReport:
        """Parse a posted report; raises ``ValueError`` (map it to HTTP 422)."""
        if not isinstance(d, Mapping):
            raise ValueError("report: expected an object")
        node = d.get("node")
        if not isinstance(node, str) or not node:
            raise ValueError("report: 'node' must be a non-empty string")
        sampled = d.get("sampled_at_s")
        if not _is_num(sampled):
            raise ValueError("report: 'sampled_at_s' must be a number")
        source = d.get("source", "")
        if not isinstance(source, str):
            raise ValueError("report: 'source' must be a string")
        gpus_raw = d.get("gpus")
        if not isinstance(gpus_raw, list):
            raise ValueError("report: 'gpus' must be a list")
        gpus = [GpuSample.from_dict(g) for g in gpus_raw]
        for g in gpus:
            if g.node != node:
                raise ValueError(f"report: gpu {g.index} names node {g.node!r}, not {node!r}")
        errors = d.get("errors", [])
        if not isinstance(errors, list) or not all(isinstance(e, str) for e in errors):
            raise ValueError("report: 'errors' must be a list of strings")
        return cls(node, float(cast(float, sampled)), source, gpus, list(errors))


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class HealthRules:
    """GPU health rules. Keys of the ``[health]`` config table; see docs/gpu-health.md."""

    max_temperature_c: float = 87.0
    """Cordon when the GPU core temperature is above this."""
    cordon_clock_events: frozenset[str] = DEFAULT_CORDON_CLOCK_EVENTS
    """Clock event reasons that cordon (names from ``CLOCK_EVENT_FLAGS``)."""
    max_ecc_uncorrectable_volatile: int = 0
    """Cordon when volatile (since driver load) uncorrectable ECC errors exceed this."""
    cordon_on_unreadable: bool = True
    """Cordon a GPU whose temperature, clock events and memory all could not be read."""
    healthy_period_s: float = 300.0
    """A health cordon is lifted only after this long of continuous healthy samples."""
    on_unhealthy: Literal["drain", "keep"] = "drain"
    """What happens to a worker running on a GPU that becomes unhealthy."""
    crash_threshold: int = 3
    """Worker crashes on one GPU within ``crash_window_s`` that cordon it."""
    crash_window_s: float = 600.0
    crash_cordon_s: float = 1800.0
    """A crash cordon lifts by itself after this long (0: only an operator lifts it)."""
    agent_silence_s: float = 30.0
    """A node whose agent was not heard for this long is "health unknown"; a gap this long
    between two samples of a GPU also restarts its healthy period."""

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], prefix: str = "health") -> HealthRules:
        """Build from a config table; ``ConfigError`` names the unknown or bad key."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"{prefix}: expected a table")
        known = set(cls.__dataclass_fields__)
        values: dict[str, Any] = {}
        for key, value in d.items():
            name = f"{prefix}.{key}"
            if key not in known:
                raise ConfigError(f"{name}: unknown key (known: {', '.join(sorted(known))})")
            if key == "cordon_clock_events":
                if not isinstance(value, (list, tuple, set, frozenset)) or not all(
                    isinstance(v, str) for v in value
                ):
                    raise ConfigError(f"{name}: expected a list of clock event names")
                bad = sorted(set(value) - set(CLOCK_EVENT_FLAGS))
                if bad:
                    raise ConfigError(
                        f"{name}: unknown clock event {bad[0]!r} "
                        f"(known: {', '.join(CLOCK_EVENT_FLAGS)})"
                    )
                values[key] = frozenset(value)
            elif key == "on_unhealthy":
                if value not in ("drain", "keep"):
                    raise ConfigError(f"{name}: expected 'drain' or 'keep', got {value!r}")
                values[key] = value
            elif key == "cordon_on_unreadable":
                if not isinstance(value, bool):
                    raise ConfigError(f"{name}: expected true or false, got {value!r}")
                values[key] = value
            elif key in ("crash_threshold", "max_ecc_uncorrectable_volatile"):
                if not _is_int(value) or value < (1 if key == "crash_threshold" else 0):
                    raise ConfigError(f"{name}: expected a non-negative integer, got {value!r}")
                values[key] = int(value)
            else:
                if not _is_num(value) or value < 0 or not math.isfinite(value):
                    raise ConfigError(f"{name}: expected a number >= 0, got {value!r}")
                values[key] = float(value)
        return cls(**values)


def evaluate(sample: GpuSample, rules: HealthRules) -> list[str]:
    """Reasons to cordon this GPU now (empty list: healthy)."""
    if sample.lost:
        return ["gpu_lost"]
    reasons: list[str] = []
    if sample.clock_event_reasons is not None:
        reasons.extend(sorted(sample.clock_event_reasons & rules.cordon_clock_events))
    if sample.temperature_c is not None and sample.temperature_c > rules.max_temperature_c:
        reasons.append(f"temperature_c={sample.temperature_c:g}>{rules.max_temperature_c:g}")
    ecc = sample.ecc_uncorrectable_volatile
    if ecc is not None and ecc > rules.max_ecc_uncorrectable_volatile:
        reasons.append(f"ecc_uncorrectable_volatile={ecc}")
    if sample.retired_pages_pending:
        reasons.append("retired_pages_pending")
    if sample.remapped_rows_pending:
        reasons.append("remapped_rows_pending")
    if sample.remapped_rows_failure:
        reasons.append("remapped_rows_failure")
    if (
        rules.cordon_on_unreadable
        and sample.temperature_c is None
        and sample.clock_event_reasons is None
        and sample.memory_total_mb is None
    ):
        reasons.append("unreadable")
    return reasons


# --------------------------------------------------------------------------- cordon book


@dataclass(frozen=True)
class CordonEntry:
    """One cordon on one GPU."""

    reason: str
    since_s: float
    source: CordonSource

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "since_s": self.since_s, "source": self.source}


@dataclass(frozen=True)
class CordonChange:
    """A cordon placed or lifted by a call on the book (for logs and events)."""

    node: str
    gpu: int
    action: Literal["cordon", "uncordon"]
    source: CordonSource
    reason: str
    drain: bool = False
    """For a new health cordon: the rules ask to drain a worker running on this GPU."""


@dataclass
class _Gpu:
    sample: GpuSample | None = None
    sample_at_s: float | None = None
    healthy_since_s: float | None = None
    crashes_s: list[float] = field(default_factory=list)
    preflight_required_mb: int = 0
    entries: dict[str, CordonEntry] = field(default_factory=dict)


class CordonBook:
    """Cordon state per GPU: which GPUs get no new worker, why, and since when.

    Sources: ``health`` (from samples, lifted after ``healthy_period_s`` of continuous
    healthy samples), ``prolog`` (the node's prolog sampled the GPU before the job and the job's
    rules judge that sample unhealthy; lifted like a health cordon), ``crash`` (repeated worker
    crashes; lifted by an operator or after ``crash_cordon_s``), ``operator`` (by hand; only an
    operator lifts it) and ``preflight`` (not enough free memory at launch; lifted when a later
    sample shows enough).
    Times passed in are the controller's clock, not the agents'.
    """

    STATE_VERSION = 1

    def __init__(self, rules: HealthRules | None = None) -> None:
        self.rules = rules or HealthRules()
        self._gpus: dict[GpuKey, _Gpu] = {}
        self._heard_s: dict[str, float] = {}

    # ---- inputs

    def observe(self, samples: Iterable[GpuSample], now_s: float) -> list[CordonChange]:
        """Take in samples (one or more agent reports' worth) and update health cordons.

        A node appearing here counts as heard. A GPU seen before on such a node but missing
        from its samples now is treated as lost (fallen off the bus).
        """
        by_node: dict[str, list[GpuSample]] = {}
        for s in samples:
            by_node.setdefault(s.node, []).append(s)
        changes = self._expire(now_s)
        for node, node_samples in sorted(by_node.items()):
            self._heard_s[node] = now_s
            present = {s.index for s in node_samples}
            for (n, idx), g in sorted(self._gpus.items()):
                if n == node and idx not in present and g.sample is not None:
                    missing = replace(
                        g.sample, lost=True, errors=["missing from the agent's report"]
                    )
                    node_samples.append(missing)
            for s in node_samples:
                changes.extend(self._observe_one(s, now_s))
        return changes

    def observe_report(self, report: AgentReport, now_s: float) -> list[CordonChange]:
        """Observe one agent report. A report with no GPUs at all (say NVML failed to start)
        does not count as hearing the node: its health stays unknown."""
        if not report.gpus:
            return self._expire(now_s)
        return self.observe(report.gpus, now_s)

    def record_prolog(self, samples: Iterable[GpuSample], now_s: float) -> list[CordonChange]:
        """Judge the prologs' samples (taken before the job) with these rules; cordon what fails.
        They do not count as hearing a node: only its agent does."""
        changes = []
        for s in samples:
            reasons = evaluate(s, self.rules)
            g = self._gpu(s.node, s.index)
            if reasons and "prolog" not in g.entries:
                reason = "before the job: " + ", ".join(reasons)
                g.entries["prolog"] = CordonEntry(reason, now_s, "prolog")
                changes.append(CordonChange(s.node, s.index, "cordon", "prolog", reason))
        return changes

    def node_heard(self, node: str, now_s: float) -> None:
        """Mark a node's agent as heard (``observe`` does this for nodes it sees)."""
        self._heard_s[node] = now_s

    def record_crash(self, node: str, gpu: int, now_s: float) -> list[CordonChange]:
        """Count a worker crash on this GPU; cordon it at ``crash_threshold`` in the window."""
        g = self._gpu(node, gpu)
        window = self.rules.crash_window_s
        g.crashes_s = [t for t in g.crashes_s if now_s - t < window] + [now_s]
        changes = self._expire(now_s)
        if len(g.crashes_s) >= self.rules.crash_threshold and "crash" not in g.entries:
            reason = f"{len(g.crashes_s)} worker crashes within {window:g}s"
            g.entries["crash"] = CordonEntry(reason, now_s, "crash")
            changes.append(CordonChange(node, gpu, "cordon", "crash", reason))
        return changes

    def record_preflight_failure(
        self, node: str, gpu: int, required_free_mb: int, reason: str, now_s: float
    ) -> CordonChange | None:
        """Cordon a GPU that failed the launch-time check, until a sample shows enough memory."""
        g = self._gpu(node, gpu)
        g.preflight_required_mb = max(required_free_mb, 0)
        if "preflight" in g.entries:
            return None
        g.entries["preflight"] = CordonEntry(reason, now_s, "preflight")
        return CordonChange(node, gpu, "cordon", "preflight", reason)

    def cordon_manual(self, node: str, gpu: int, reason: str, now_s: float) -> CordonChange:
        """An operator cordon: sticky until :meth:`uncordon_manual`."""
        g = self._gpu(node, gpu)
        entry = CordonEntry(reason or "cordoned by operator", now_s, "operator")
        g.entries["operator"] = entry
        return CordonChange(node, gpu, "cordon", "operator", entry.reason)

    def uncordon_manual(self, node: str, gpu: int, now_s: float) -> list[CordonChange]:
        """Lift operator, prolog, crash and pre-flight cordons (and forget counted crashes).

        A health cordon stays: it lifts by itself after the healthy period.
        """
        g = self._gpus.get((node, gpu))
        if g is None:
            return []
        changes = []
        for source in ("operator", "prolog", "crash", "preflight"):
            entry = g.entries.pop(source, None)
            if entry is not None:
                changes.append(CordonChange(node, gpu, "uncordon", entry.source, "by operator"))
        g.crashes_s = []
        return changes

    def tick(self, now_s: float) -> list[CordonChange]:
        """Lift time-limited cordons (crash cordons past ``crash_cordon_s``)."""
        return self._expire(now_s)

    # ---- queries

    def cordoned(self) -> dict[GpuKey, CordonEntry]:
        """The cordoned GPUs, each with its main entry (operator > health > crash > preflight)."""
        out: dict[GpuKey, CordonEntry] = {}
        for key, g in sorted(self._gpus.items()):
            for source in _SOURCE_PRECEDENCE:
                if source in g.entries:
                    out[key] = g.entries[source]
                    break
        return out

    def entries(self, node: str, gpu: int) -> list[CordonEntry]:
        """All cordons on one GPU, main one first (for status)."""
        g = self._gpus.get((node, gpu))
        if g is None:
            return []
        return [g.entries[s] for s in _SOURCE_PRECEDENCE if s in g.entries]

    def drain_targets(self) -> set[GpuKey]:
        """GPUs whose running worker should be drained now (health cordons, if the rules say
        ``on_unhealthy = "drain"``). Level-triggered: ask every tick."""
        if self.rules.on_unhealthy != "drain":
            return set()
        return {key for key, g in self._gpus.items() if "health" in g.entries}

    def unknown_nodes(
        self, now_s: float, silence_s: float | None = None, nodes: Iterable[str] = ()
    ) -> set[str]:
        """Nodes whose agent was not heard within ``silence_s`` (default from the rules),
        plus any of ``nodes`` (the allocation's nodes) never heard at all."""
        limit = self.rules.agent_silence_s if silence_s is None else silence_s
        out = {n for n, t in self._heard_s.items() if now_s - t > limit}
        out.update(n for n in nodes if n not in self._heard_s)
        return out

    def latest_sample(self, node: str, gpu: int) -> GpuSample | None:
        g = self._gpus.get((node, gpu))
        return None if g is None else g.sample

    def known_gpus(self, node: str) -> list[int]:
        """Indexes of this node's GPUs in its latest reports."""
        return sorted(i for (n, i), g in self._gpus.items() if n == node and g.sample)

    def preflight_ok(self, node: str, gpu: int, required_free_mb: int) -> tuple[bool, str]:
        """Launch-time check: the latest sample of **this** GPU has enough free memory."""
        s = self.latest_sample(node, gpu)
        where = f"{node}:{gpu}"
        if s is None:
            return False, f"no telemetry for {where}"
        if s.lost:
            return False, f"{where} is lost"
        free = s.memory_free_mb
        if free is None:
            return False, f"free memory of {where} unknown"
        if free < required_free_mb:
            return False, f"{where} has {free} MiB free, worker needs {required_free_mb} MiB"
        return True, ""

    def schedulable(
        self, node: str, gpu: int, now_s: float, silence_s: float | None = None
    ) -> tuple[bool, str]:
        """May a new worker go on this GPU? Not cordoned, node heard recently, GPU reported."""
        entry = self.cordoned().get((node, gpu))
        if entry is not None:
            return False, f"cordoned ({entry.source}): {entry.reason}"
        if node in self.unknown_nodes(now_s, silence_s, nodes=[node]):
            return False, f"health of {node} unknown (agent silent)"
        if self.latest_sample(node, gpu) is None:
            return False, f"no telemetry for {node}:{gpu}"
        return True, ""

    # ---- persistence

    def to_state(self) -> dict[str, Any]:
        """JSON-serialisable state (no samples: they are stale after a restart)."""
        gpus = []
        for (node, idx), g in sorted(self._gpus.items()):
            if not g.entries and not g.crashes_s and g.healthy_since_s is None:
                continue
            gpus.append(
                {
                    "node": node,
                    "gpu": idx,
                    "healthy_since_s": g.healthy_since_s,
                    "crashes_s": list(g.crashes_s),
                    "preflight_required_mb": g.preflight_required_mb,
                    "entries": [g.entries[s].to_dict() for s in sorted(g.entries)],
                }
            )
        return {"version": self.STATE_VERSION, "heard_s": dict(self._heard_s), "gpus": gpus}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], rules: HealthRules | None = None) -> CordonBook:
        """Rebuild from :meth:`to_state`; raises ``ValueError`` on a foreign or bad state."""
        if not isinstance(state, Mapping) or state.get("version") != cls.STATE_VERSION:
            raise ValueError(f"cordon state: expected version {cls.STATE_VERSION}")
        book = cls(rules)
        try:
            for node, t in dict(state.get("heard_s", {})).items():
                book._heard_s[str(node)] = float(t)
            for item in state.get("gpus", []):
                g = book._gpu(str(item["node"]), int(item["gpu"]))
                hs = item.get("healthy_since_s")
                g.healthy_since_s = None if hs is None else float(hs)
                g.crashes_s = [float(t) for t in item.get("crashes_s", [])]
                g.preflight_required_mb = int(item.get("preflight_required_mb", 0))
                for e in item.get("entries", []):
                    source = e["source"]
                    if source not in _SOURCE_PRECEDENCE:
                        raise ValueError(f"cordon state: unknown source {source!r}")
                    g.entries[source] = CordonEntry(str(e["reason"]), float(e["since_s"]), source)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"cordon state: malformed ({exc!r})") from None
        return book

    # ---- internals

    def _gpu(self, node: str, gpu: int) -> _Gpu:
        return self._gpus.setdefault((node, gpu), _Gpu())

    def _observe_one(self, s: GpuSample, now_s: float) -> list[CordonChange]:
        g = self._gpu(s.node, s.index)
        gap_s = None if g.sample_at_s is None else now_s - g.sample_at_s
        g.sample, g.sample_at_s = s, now_s
        changes: list[CordonChange] = []
        pre = g.entries.get("preflight")
        free = s.memory_free_mb
        if pre is not None and not s.lost and free is not None and free >= g.preflight_required_mb:
            del g.entries["preflight"]
            changes.append(CordonChange(s.node, s.index, "uncordon", "preflight", "memory free"))
        reasons = evaluate(s, self.rules)
        if reasons:
            g.healthy_since_s = None
            reason = ", ".join(reasons)
            old = g.entries.get("health")
            if old is None:
                g.entries["health"] = CordonEntry(reason, now_s, "health")
                drain = self.rules.on_unhealthy == "drain"
                changes.append(CordonChange(s.node, s.index, "cordon", "health", reason, drain))
            elif old.reason != reason:
                g.entries["health"] = replace(old, reason=reason)
            return changes
        watched = [source for source in _WATCHED if source in g.entries]
        if not watched:
            g.healthy_since_s = None
            return changes
        if g.healthy_since_s is None or (gap_s is not None and gap_s > self.rules.agent_silence_s):
            g.healthy_since_s = now_s
        if now_s - g.healthy_since_s >= self.rules.healthy_period_s:
            g.healthy_since_s = None
            period = f"healthy for {self.rules.healthy_period_s:g}s"
            for source in watched:
                del g.entries[source]
                changes.append(CordonChange(s.node, s.index, "uncordon", source, period))
        return changes

    def _expire(self, now_s: float) -> list[CordonChange]:
        limit = self.rules.crash_cordon_s
        changes: list[CordonChange] = []
        if limit <= 0:
            return changes
        for (node, idx), g in sorted(self._gpus.items()):
            entry = g.entries.get("crash")
            if entry is not None and now_s - entry.since_s >= limit:
                del g.entries["crash"]
                g.crashes_s = []
                changes.append(CordonChange(node, idx, "uncordon", "crash", "crash cordon expired"))
        return changes


def parse_gpu_ref(ref: str) -> GpuKey:
    """``"node1:2"`` -> ``("node1", 2)``; raises ``ValueError``."""
    node, sep, idx = ref.rpartition(":")
    if not sep or not node or not idx.isdigit():
        raise ValueError(f"expected NODE:GPU (e.g. node1:2), got {ref!r}")
    return node, int(idx)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt_num(d: Mapping[str, Any], key: str) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if not _is_num(v):
        raise ValueError(f"gpu sample: {key!r} must be a number or null")
    return float(v)


def _opt_int(d: Mapping[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise ValueError(f"gpu sample: {key!r} must be an integer or null")
    return int(v)


def _opt_bool(d: Mapping[str, Any], key: str) -> bool | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise ValueError(f"gpu sample: {key!r} must be a boolean or null")
    return v
