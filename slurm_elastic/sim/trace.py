"""A workload trace for the simulator: what the cluster, the queue, the trainer and the rollouts do.

Pure: :func:`parse_trace` takes TOML text (or an already-parsed mapping) and validates every
field, raising :class:`~slurm_elastic.errors.ConfigError` with the field's dotted name.
docs/autoscaler.md documents each field; ``examples/traces/`` has examples.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from slurm_elastic.core.autoscaler_config import AutoscalerConfig
from slurm_elastic.core.defaults import (
    BACKOFF_BASE_S,
    BACKOFF_MAX_S,
    DRAIN_TIMEOUT_S,
    HEARTBEAT_GRACE_S,
    TICK_INTERVAL_S,
)
from slurm_elastic.core.limits import MAX_DURATION_S, MAX_SEQS, MAX_STALENESS, MAX_WORKERS, shown
from slurm_elastic.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DISTRIBUTIONS = ("fixed", "exponential", "lognormal", "pareto")


@dataclass(frozen=True)
class ClusterSpec:
    gpu_slots: int = 8  # worker slots (one GPU per worker)
    initial_workers: int = 2  # launched at t = 0 by the adaptive policies
    startup_s: float = 1.0  # launch -> registered (STARTING -> ACTIVE); must stay below heartbeat_grace_s
    warmup_s: float = 0.0  # registered -> first rollout (model loading; ACTIVE but producing nothing)
    tick_interval_s: float = TICK_INTERVAL_S  # the controller's tick
    drain_timeout_s: float = DRAIN_TIMEOUT_S  # a draining worker is cancelled after this
    backoff_base_s: float = BACKOFF_BASE_S  # crash-loop backoff before a relaunch (doubles per crash of that worker)
    backoff_max_s: float = BACKOFF_MAX_S
    heartbeat_grace_s: float = HEARTBEAT_GRACE_S


@dataclass(frozen=True)
class QueueSpec:
    batch_size: int = 64  # sequences per trainer step
    group_size: int = 8  # sequences per rollout (one admission, one submit)
    capacity_seqs: int = 512  # the buffer's bound
    max_staleness: int = 2  # AReaL's bound (policy versions)
    max_concurrent: int = 1024
    admission_ttl_s: float = 600.0  # an unused admission (crashed worker) is released after this


@dataclass(frozen=True)
class TrainerSpec:
    step_s: float = 10.0  # compute time of one trainer step
    step_jitter: float = 0.0  # relative: each step takes step_s * U(1 - j, 1 + j)


@dataclass(frozen=True)
class RolloutSpec:
    """Time one worker takes for one group (one rollout)."""

    distribution: str = "lognormal"
    median_s: float = 8.0
    sigma: float = 0.5  # lognormal: sigma of log(time)
    alpha: float = 1.8  # pareto: tail index (smaller = heavier tail)
    max_s: float = 600.0  # longest rollout (a generation limit)

    def sample_s(self, rng: random.Random) -> float:
        if self.distribution == "fixed":
            value = self.median_s
        elif self.distribution == "exponential":
            value = self.median_s / math.log(2) * rng.expovariate(1.0)
        elif self.distribution == "lognormal":
            value = self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        else:  # pareto with this median: x_m * 2^(1/alpha) = median
            value = self.median_s / 2 ** (1 / self.alpha) * rng.paretovariate(self.alpha)
        return min(self.max_s, value)


@dataclass(frozen=True)
class Phase:
    """From ``start_s`` on, rollouts take ``rollout_scale`` times and trainer steps ``trainer_scale`` times as long."""

    start_s: float = 0.0
    rollout_scale: float = 1.0
    trainer_scale: float = 1.0


@dataclass(frozen=True)
class Failure:
    """At ``at_s``, ``workers`` running workers (chosen by the seeded RNG) die without warning."""

    at_s: float = 0.0
    workers: int = 1


@dataclass(frozen=True)
class Throttle:
    """GPU slots ``gpus`` are ``slowdown`` times slower in [start_s, start_s + duration_s)."""

    start_s: float = 0.0
    duration_s: float = 60.0
    slowdown: float = 2.0
    gpus: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class Baselines:
    """Knobs of the comparison policies (verl's threshold ±1 and DEO's proportional-deadband)."""

    static_mid_workers: int = 0  # 0 = half the GPU slots
    threshold_interval_s: float = 5.0  # verl's monitoring_interval
    deo_kp_workers_per_batch: float = 1.0
    deo_deadband_batches: float = 0.5


@dataclass(frozen=True)
class Trace:
    name: str = "trace"
    description: str = ""
    duration_s: float = 1800.0
    seed: int = 0
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    queue: QueueSpec = field(default_factory=QueueSpec)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    phases: tuple[Phase, ...] = ()
    failures: tuple[Failure, ...] = ()
    throttles: tuple[Throttle, ...] = ()
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    baselines: Baselines = field(default_factory=Baselines)

    def phase_at(self, now_s: float) -> Phase:
        current = Phase()
        for phase in self.phases:
            if phase.start_s <= now_s:
                current = phase
        return current

    def slowdown_at(self, slot: int, now_s: float) -> float:
        factor = 1.0
        for t in self.throttles:
            if slot in t.gpus and t.start_s <= now_s < t.start_s + t.duration_s:
                factor = max(factor, t.slowdown)
        return factor


T = TypeVar("T")
_POSITIVE = {"gpu_slots", "batch_size", "group_size", "capacity_seqs", "max_concurrent", "tick_interval_s",
             "step_s", "median_s", "max_s", "duration_s", "rollout_scale", "trainer_scale", "alpha",
             "slowdown", "heartbeat_grace_s", "workers", "admission_ttl_s", "drain_timeout_s", "backoff_base_s",
             "backoff_max_s", "threshold_interval_s"}
# The largest value of each number (any other ``*_s``: a year, core/limits.py), and why.
_LARGEST: dict[str, tuple[float, str]] = {
    "gpu_slots": (MAX_WORKERS, "Slurm's MaxStepCount, steps per job by default"),
    "initial_workers": (MAX_WORKERS, "Slurm's MaxStepCount, steps per job by default"),
    "workers": (MAX_WORKERS, "Slurm's MaxStepCount, steps per job by default"),
    "static_mid_workers": (MAX_WORKERS, "Slurm's MaxStepCount, steps per job by default"),
    "batch_size": (MAX_SEQS, "2^31 sequences"),
    "group_size": (MAX_SEQS, "2^31 sequences"),
    "capacity_seqs": (MAX_SEQS, "2^31 sequences"),
    "max_concurrent": (MAX_SEQS, "2^31 sequences"),
    "max_staleness": (MAX_STALENESS, "past a thousand versions the bound bounds nothing"),
    "step_jitter": (1.0, "a step takes step_s times U(1 - j, 1 + j): past 1 some steps would take negative time"),
    "sigma": (10.0, "rollout times spread over e^(±10 per sigma) already; past it a draw overflows a float"),
    "alpha": (100.0, "a tail index of 100 is a fixed time already"),
    "rollout_scale": (1000.0, "a thousand times slower"),
    "trainer_scale": (1000.0, "a thousand times slower"),
    "slowdown": (1000.0, "a thousand times slower"),
    "deo_kp_workers_per_batch": (1000.0, "a thousand workers per batch of error"),
    "deo_deadband_batches": (1000.0, "a thousand batches"),
}
_SMALLEST = {"alpha": (0.1, "below it a draw of the Pareto distribution overflows a float")}
MAX_TICKS = 10**6  # duration_s / tick_interval_s: a million ticks take minutes to simulate


def _build(cls: type[T], data: Any, prefix: str) -> T:
    """A frozen dataclass from a TOML table: unknown keys, wrong types and bad ranges name the field."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix}: must be a table")
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}"
        if key not in known:
            raise ConfigError(f"{name}: unknown field (known: {', '.join(known)})")
        default = known[key].default
        if isinstance(default, str):
            if not isinstance(value, str):
                raise ConfigError(f"{name}: must be a string")
        elif isinstance(default, tuple):
            if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise ConfigError(f"{name}: must be a list of integers")
            if any(v < 0 for v in value):
                raise ConfigError(f"{name}: GPU slot numbers must be >= 0")
            value = tuple(value)
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name}: must be an integer")
        elif isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(f"{name}: must be a number")
        if isinstance(value, int | float) and not isinstance(value, bool):
            if key in _POSITIVE and value <= 0:
                raise ConfigError(f"{name}: must be > 0")
            if value < 0:
                raise ConfigError(f"{name}: must be >= 0")
            largest, why = _LARGEST.get(key, (MAX_DURATION_S, "a year") if key.endswith("_s") else (0, ""))
            if why and value > largest:
                raise ConfigError(f"{name}: {shown(value)} is above its largest, {shown(largest)} ({why})")
            if key in _SMALLEST and value < _SMALLEST[key][0]:
                raise ConfigError(f"{name}: {shown(value)} is below its least, {shown(_SMALLEST[key][0])} ({_SMALLEST[key][1]})")
            value = float(value) if isinstance(default, float) else value
        values[key] = value
    return cls(**values)


def _array(cls: type[T], data: Any, prefix: str) -> tuple[T, ...]:
    if not isinstance(data, list):
        raise ConfigError(f"{prefix}: must be an array of tables ([[{prefix}]])")
    return tuple(_build(cls, item, f"{prefix}[{index}]") for index, item in enumerate(data))


def parse_trace(source: str | Mapping[str, Any], name: str = "trace") -> Trace:
    """Validate a trace given as TOML text or as a mapping; every error names its field."""
    if isinstance(source, str):
        try:
            data: Mapping[str, Any] = tomllib.loads(source)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{name}: not valid TOML: {exc}") from exc
    else:
        data = source
    tables = {"cluster": ClusterSpec, "queue": QueueSpec, "trainer": TrainerSpec, "rollout": RolloutSpec,
              "baselines": Baselines}
    arrays = {"phases": Phase, "failures": Failure, "throttles": Throttle}
    top: dict[str, Any] = {}
    parts: dict[str, Any] = {}
    for key, value in data.items():
        if key in tables:
            parts[key] = _build(tables[key], value, key)
        elif key in arrays:
            parts[key] = _array(arrays[key], value, key)
        elif key == "autoscaler":
            if not isinstance(value, Mapping):
                raise ConfigError("autoscaler: must be a table")
            parts[key] = AutoscalerConfig.from_mapping(value)
        elif key in ("name", "description"):
            if not isinstance(value, str):
                raise ConfigError(f"{key}: must be a string")
            top[key] = value
        elif key in ("duration_s", "seed"):
            top[key] = _number(key, value)
        else:
            raise ConfigError(f"{key}: unknown field (known: name, description, duration_s, seed, "
                              f"{', '.join([*tables, *arrays, 'autoscaler'])})")
    trace = Trace(**top, **parts)
    _check(trace)
    return trace


def _number(key: str, value: Any) -> float | int:
    if key == "seed":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError("seed: must be an integer >= 0")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key}: must be a number > 0")
    if value > MAX_DURATION_S:
        raise ConfigError(f"{key}: {shown(value)} is above its largest, {shown(MAX_DURATION_S)} (a year)")
    return float(value)


def _check(trace: Trace) -> None:
    """Cross-field rules."""
    q, c, r = trace.queue, trace.cluster, trace.rollout
    if q.batch_size % q.group_size:
        raise ConfigError(f"queue.batch_size ({q.batch_size}) must be a multiple of queue.group_size ({q.group_size})")
    if q.capacity_seqs < q.batch_size:
        raise ConfigError(f"queue.capacity_seqs ({q.capacity_seqs}) must hold at least one batch ({q.batch_size})")
    if r.distribution not in DISTRIBUTIONS:
        raise ConfigError(f"rollout.distribution: one of {', '.join(DISTRIBUTIONS)} (got {r.distribution!r})")
    if r.max_s < r.median_s:
        raise ConfigError(f"rollout.max_s ({r.max_s:g}) is below rollout.median_s ({r.median_s:g}): every "
                          "rollout would take max_s")
    if c.backoff_base_s > c.backoff_max_s:
        raise ConfigError(f"cluster.backoff_base_s ({c.backoff_base_s:g}) > cluster.backoff_max_s ({c.backoff_max_s:g})")
    if trace.duration_s / c.tick_interval_s > MAX_TICKS:
        raise ConfigError(f"cluster.tick_interval_s ({c.tick_interval_s:g}) makes {trace.duration_s / c.tick_interval_s:.3g} "
                          f"ticks of duration_s ({trace.duration_s:g}); at most {MAX_TICKS:,} are simulated")
    events = [(f"phases[{i}].start_s", p.start_s) for i, p in enumerate(trace.phases)]
    events += [(f"failures[{i}].at_s", f.at_s) for i, f in enumerate(trace.failures)]
    events += [(f"throttles[{i}].start_s", t.start_s) for i, t in enumerate(trace.throttles)]
    for name, at_s in events:
        if at_s >= trace.duration_s:
            raise ConfigError(f"{name} ({at_s:g}) is not before duration_s ({trace.duration_s:g}): it would never happen")
    for index, failure in enumerate(trace.failures):
        if failure.workers > c.gpu_slots:
            raise ConfigError(f"failures[{index}].workers ({failure.workers}) > cluster.gpu_slots ({c.gpu_slots})")
    if c.initial_workers > c.gpu_slots:
        raise ConfigError(f"cluster.initial_workers ({c.initial_workers}) > cluster.gpu_slots ({c.gpu_slots})")
    if c.startup_s >= c.heartbeat_grace_s:
        raise ConfigError(f"cluster.startup_s ({c.startup_s:g}) must be below cluster.heartbeat_grace_s "
                          f"({c.heartbeat_grace_s:g}): model loading belongs in cluster.warmup_s")
    if trace.baselines.static_mid_workers > c.gpu_slots:
        raise ConfigError(f"baselines.static_mid_workers ({trace.baselines.static_mid_workers}) > cluster.gpu_slots")
    for index, throttle in enumerate(trace.throttles):
        if not throttle.gpus:
            raise ConfigError(f"throttles[{index}].gpus: names no GPU slot, so it would slow nothing")
        if any(g >= c.gpu_slots for g in throttle.gpus):
            raise ConfigError(f"throttles[{index}].gpus: slots are 0..{c.gpu_slots - 1}")
