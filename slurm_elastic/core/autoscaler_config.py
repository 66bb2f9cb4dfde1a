"""The autoscaler's knobs (``[autoscaler]``), validated once at the edge; verl's ``ElasticConfig``
names are accepted, and names of knobs that another key holds here are refused naming that key."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from slurm_elastic.core.limits import MAX_DURATION_S, MAX_REPEATS, MAX_SEQS, MAX_WORKERS, shown
from slurm_elastic.errors import ConfigError, unknown_key

# verl's ElasticConfig names -> ours (docs/autoscaler.md explains each)
VERL_ALIASES: dict[str, str] = {
    "scale_up_threshold": "scale_up_threshold",
    "scale_down_threshold": "scale_down_threshold",
    "min_workers": "min_workers",
    "max_workers": "max_workers",
    "requests_per_worker_capacity": "requests_per_worker_capacity",
    "scale_up_cooldown": "scale_up_cooldown_s",
    "scale_down_cooldown": "scale_down_cooldown_s",
    "min_stable_period": "min_stable_period_s",
    "enable_elastic": "enabled",
}
# verl's names of knobs another key holds here: refused, naming that key
REFUSED_KEYS: dict[str, str] = {
    "monitoring_interval": "the autoscaler decides every tick: set controller.tick_interval_s",
    "monitoring_interval_s": "the autoscaler decides every tick: set controller.tick_interval_s",
    "drain_timeout": "set workers.drain_timeout_s",
    "drain_timeout_s": "set workers.drain_timeout_s",
}


POSITIVE = {  # knobs the law divides by
    "horizon_s": "the control law closes the buffer's error within about this long",
    "requests_per_worker_capacity": "a server's load is its outstanding requests over this",
    "setpoint_batches": "the buffer the law aims for; at 0 the trainer waits at every step",
}
# The largest value of each knob, and why. The law asks for w_ff + u / (rate * horizon_s) workers,
# u = kp*a + ki*integral(a) - kd*d(queued)/dt: past these bounds one term alone pins the target at a
# bound. (examples/traces/steady.toml, simulated: kp = 1e300 recommended 9.9e158 workers at the first
# error after start-up, held at max_workers 12; kp = 10 made the same scale-up, 16,333 -> 17,011
# GPU-s at the same trainer idle fraction; kp = 3 ran as the default 1.)
_YEAR = "a year: longer than any Slurm job runs"
LARGEST: dict[str, tuple[float, str]] = {
    "kp": (10.0, "kp = 1 closes the buffer's error within horizon_s, 10 within a tenth of it (3 s at the "
                 "default 30 s, about a tick): a larger gain asks for workers faster than the law sees what "
                 "the last ones did"),
    "ki": (1.0, "the integral's time constant 1/ki (20 s by default) would be under a second, shorter than a "
                "tick: the integral only winds up between two decisions"),
    "kd": (60.0, "kd extrapolates the buffer's change over kd seconds; past a minute one pull, a batch out of "
                 "the buffer at once, reads as a minute of missing production"),
    "horizon_s": (3600.0, "the law closes the buffer's error within about this long; past an hour it hardly "
                          "answers any error within a job"),
    "setpoint_batches": (1000.0, "a buffer of a thousand batches is stale long before the trainer reaches it"),
    "setpoint_floor_batches": (1000.0, "as setpoint_batches, which it may not exceed"),
    "deadband_workers": (float(MAX_WORKERS), f"no job runs more than {MAX_WORKERS} worker steps"),
    "min_workers": (MAX_WORKERS, f"Slurm's MaxStepCount: {MAX_WORKERS} steps per job by default"),
    "max_workers": (MAX_WORKERS, f"Slurm's MaxStepCount: {MAX_WORKERS} steps per job by default"),
    "max_step_up": (MAX_WORKERS, "a step larger than max_workers is max_workers"),
    "max_step_down": (MAX_WORKERS, "a step larger than max_workers is max_workers"),
    "confirmations": (MAX_REPEATS, "a thousand ticks in a row is over half an hour at the default tick"),
    "scale_up_cooldown_s": (MAX_DURATION_S, _YEAR),
    "scale_down_cooldown_s": (MAX_DURATION_S, _YEAR),
    "min_stable_period_s": (MAX_DURATION_S, _YEAR),
    "stabilization_window_s": (MAX_DURATION_S, _YEAR),
    "startup_trainer_step_s": (MAX_DURATION_S, _YEAR),
    "integral_limit_seqs_s": (MAX_SEQS * MAX_DURATION_S, "the largest buffer's error held for a year"),
    "startup_worker_seqs_per_s": (1e6, "a million sequences a second from one worker"),
    "requests_per_worker_capacity": (1e6, "a million requests outstanding on one server"),
    "scale_up_threshold": (100.0, "a load ratio: a server's outstanding requests over its capacity"),
    "scale_down_threshold": (100.0, "a load ratio: a server's outstanding requests over its capacity"),
}


@dataclass(frozen=True)
class AutoscalerConfig:
    """Knobs of the policy; every duration in seconds, every amount in sequences or workers."""

    enabled: bool = True
    min_workers: int = 1
    max_workers: int = 64
    setpoint_batches: float = 2.0  # keep this many trainer batches buffered
    setpoint_floor_batches: float = 0.75  # the least the staleness room may lower the setpoint to
    kp: float = 1.0  # [1]: sequences of error -> sequences of correction
    ki: float = 0.05  # [1/s]
    kd: float = 0.5  # [s]: on the measured buffer's rate of change
    horizon_s: float = 30.0  # close the buffer error within about this long
    deadband_workers: float = 0.5
    confirmations: int = 2
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 60.0
    min_stable_period_s: float = 10.0
    stabilization_window_s: float = 120.0
    max_step_up: int = 4
    max_step_down: int = 2
    integral_limit_seqs_s: float = 1e6
    startup_trainer_step_s: float = 0.0  # a trainer step's time, known before it is measured; 0: unknown
    startup_worker_seqs_per_s: float = 0.0  # one busy worker's production before it is measured; 0: unknown
    requests_per_worker_capacity: float = 8.0
    scale_up_threshold: float = 0.8
    scale_down_threshold: float = 0.5

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], prefix: str = "autoscaler") -> AutoscalerConfig:
        """Validate ``[autoscaler]``; verl's names are accepted; errors name the key."""
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        given_as: dict[str, str] = {}  # our name -> the key that gave it (ours or verl's)
        for key, value in data.items():
            if key in REFUSED_KEYS:
                raise ConfigError(f"{prefix}.{key}: not an [autoscaler] key here; {REFUSED_KEYS[key]}")
            name = VERL_ALIASES.get(key, key)
            if name not in known:
                raise ConfigError(f"{prefix}.{key}: {unknown_key(key, [*known, *VERL_ALIASES])}")
            if name in given_as:
                raise ConfigError(f"{prefix}.{key}: given twice (also as {prefix}.{given_as[name]})")
            given_as[name] = key
            default = known[name].default
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ConfigError(f"{prefix}.{key}: must be true or false")
            elif isinstance(default, int):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ConfigError(f"{prefix}.{key}: must be an integer")
            elif isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{prefix}.{key}: must be a number")
            if not isinstance(value, bool) and not math.isfinite(value):
                raise ConfigError(f"{prefix}.{key}: must be a finite number, not {value}")
            if not isinstance(value, bool) and value < 0:
                raise ConfigError(f"{prefix}.{key}: must be >= 0")
            if name in POSITIVE and value <= 0:
                raise ConfigError(f"{prefix}.{key}: must be > 0 ({POSITIVE[name]})")
            if name in LARGEST and value > LARGEST[name][0]:
                largest, why = LARGEST[name]
                raise ConfigError(f"{prefix}.{key}: {shown(value)} is above its largest, {shown(largest)} ({why})")
            values[name] = value
        if "setpoint_floor_batches" not in values and "setpoint_batches" in values:  # follows a lower setpoint
            values["setpoint_floor_batches"] = min(cls.setpoint_floor_batches, values["setpoint_batches"])
        config = cls(**values)
        if config.min_workers > config.max_workers:
            raise ConfigError(f"{prefix}.min_workers ({config.min_workers}) > max_workers ({config.max_workers})")
        if config.scale_down_threshold >= config.scale_up_threshold:
            raise ConfigError(f"{prefix}.scale_down_threshold ({config.scale_down_threshold:g}) must be below "
                              f"scale_up_threshold ({config.scale_up_threshold:g})")
        if config.setpoint_floor_batches > config.setpoint_batches:
            raise ConfigError(f"{prefix}.setpoint_floor_batches ({config.setpoint_floor_batches:g}) > "
                              f"setpoint_batches ({config.setpoint_batches:g})")
        for name in ("confirmations", "max_step_up", "max_step_down"):
            if getattr(config, name) < 1:
                raise ConfigError(f"{prefix}.{name}: must be >= 1")
        moves = config.max_workers - config.min_workers  # the largest change of the count
        if config.enabled and moves > 0 and config.deadband_workers >= moves:
            raise ConfigError(f"{prefix}.deadband_workers ({config.deadband_workers:g}) must be below max_workers - "
                              f"min_workers ({moves}): no change of the worker count would ever leave the deadband")
        return config
