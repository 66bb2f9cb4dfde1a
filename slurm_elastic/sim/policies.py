"""The policies the simulator can run: ours (the real :class:`Autoscaler`) and the baselines it is
compared with. Every policy maps (:class:`PressureInputs`, now) to a :class:`Decision`. Pure.

- ``static-max`` / ``static-mid``: a fixed worker count.
- ``threshold``: verl's ``ElasticConfig`` design, ±1 worker when the load leaves
  [scale_down_threshold, scale_up_threshold], with its cooldowns, min_stable_period and
  monitoring_interval. verl's load ratio is outstanding requests / capacity; for a rollout buffer
  we read it as the trainer's unmet appetite ``L = setpoint / (setpoint + queued)`` (1 when the
  buffer is empty, 0.5 at the setpoint), so verl's defaults 0.8 / 0.5 mean "+1 below a quarter of
  the setpoint, -1 above the setpoint".
- ``deo``: the DEO orchestrator's proportional controller on rollout pressure (queue / batch size)
  with a deadband, sign corrected (a short queue adds workers): no I, no D, no hysteresis, no cooldown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slurm_elastic.core.autoscaler_config import AutoscalerConfig
from slurm_elastic.core.scaling import Autoscaler, Decision, PressureInputs
from slurm_elastic.core.tick import ScalingPolicy
from slurm_elastic.sim.trace import Trace

POLICIES = ("ours", "static-max", "static-mid", "threshold", "deo")
Policy = ScalingPolicy


def _bounds(cfg: AutoscalerConfig, x: PressureInputs) -> tuple[int, int]:
    return cfg.min_workers, max(cfg.min_workers, min(cfg.max_workers, x.allowed_slots))


@dataclass
class StaticPolicy:
    workers: int

    def decide(self, x: PressureInputs, now_s: float) -> Decision:
        current = x.workers_starting + x.workers_active
        action = "hold" if current == self.workers else ("scale_up" if self.workers > current else "scale_down")
        return Decision(self.workers, action, f"static allocation of {self.workers} workers")


@dataclass
class ThresholdPolicy:
    """verl's ±1 policy: thresholds on a load ratio, cooldowns, a stable period, a monitoring interval."""

    config: AutoscalerConfig
    interval_s: float = 5.0
    last_check_s: float = -math.inf
    last_up_s: float = -math.inf
    last_down_s: float = -math.inf
    outside_since_s: float | None = None
    outside_dir: int = 0

    def decide(self, x: PressureInputs, now_s: float) -> Decision:
        cfg = self.config
        current = x.workers_starting + x.workers_active
        low, high = _bounds(cfg, x)
        if x.queued_seqs is None or x.batch_size <= 0 or now_s - self.last_check_s < self.interval_s:
            return Decision(min(max(current, low), high), "hold", "between monitoring intervals")
        self.last_check_s = now_s
        setpoint = cfg.setpoint_batches * x.batch_size
        load = setpoint / (setpoint + x.queued_seqs)
        direction = 1 if load > cfg.scale_up_threshold else -1 if load < cfg.scale_down_threshold else 0
        if direction != self.outside_dir:
            self.outside_dir, self.outside_since_s = direction, now_s
        why = f"load {load:.2f} vs [{cfg.scale_down_threshold}, {cfg.scale_up_threshold}]"
        target = current + direction
        if direction == 0 or not low <= target <= high:
            return Decision(min(max(current, low), high), "hold", why)
        assert self.outside_since_s is not None
        if now_s - self.outside_since_s < cfg.min_stable_period_s:
            return Decision(current, "hold", f"{why}: not stable yet")
        if direction > 0 and now_s - self.last_up_s < cfg.scale_up_cooldown_s:
            return Decision(current, "hold", f"{why}: scale-up cooldown")
        if direction < 0 and now_s - self.last_down_s < cfg.scale_down_cooldown_s:
            return Decision(current, "hold", f"{why}: scale-down cooldown")
        if direction > 0:
            self.last_up_s = now_s
        else:
            self.last_down_s = now_s
        return Decision(target, "scale_up" if direction > 0 else "scale_down", why)


@dataclass
class DeoPolicy:
    """Proportional on the buffer error in batches, with a deadband; sign corrected."""

    config: AutoscalerConfig
    kp_workers_per_batch: float = 1.0
    deadband_batches: float = 0.5

    def decide(self, x: PressureInputs, now_s: float) -> Decision:
        cfg = self.config
        current = x.workers_starting + x.workers_active
        low, high = _bounds(cfg, x)
        if x.queued_seqs is None or x.batch_size <= 0:
            return Decision(min(max(current, low), high), "hold", "no buffer measurement")
        error_batches = cfg.setpoint_batches - x.queued_seqs / x.batch_size
        if abs(error_batches) <= self.deadband_batches:
            return Decision(min(max(current, low), high), "hold", f"pressure error {error_batches:.2f} in deadband")
        target = min(max(current + round(self.kp_workers_per_batch * error_batches), low), high)
        action = "hold" if target == current else ("scale_up" if target > current else "scale_down")
        return Decision(target, action, f"pressure error {error_batches:.2f} batches")


@dataclass
class PolicySeat:
    """The autoscaler's seat in the simulated controller: the run's policy decides there, and the
    inputs it saw and its decision are kept for the tick's sample."""

    policy: Policy
    inputs: PressureInputs | None = None
    decision: Decision | None = None

    def decide(self, x: PressureInputs, now_s: float) -> Decision:
        self.inputs, self.decision = x, self.policy.decide(x, now_s)
        return self.decision


def make_policy(name: str, trace: Trace) -> Policy:
    """A fresh policy by name (one of :data:`POLICIES`), configured from the trace."""
    slots = trace.cluster.gpu_slots
    cfg = trace.autoscaler
    top = min(slots, cfg.max_workers)
    if name == "ours":
        return Autoscaler(cfg)
    if name == "static-max":
        return StaticPolicy(top)
    if name == "static-mid":
        return StaticPolicy(trace.baselines.static_mid_workers or max(1, top // 2))
    if name == "threshold":
        return ThresholdPolicy(cfg, trace.baselines.threshold_interval_s)
    if name == "deo":
        return DeoPolicy(cfg, trace.baselines.deo_kp_workers_per_batch, trace.baselines.deo_deadband_batches)
    raise ValueError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})")


def initial_workers(name: str, trace: Trace) -> int:
    """Workers launched at t = 0: a static policy starts at its size, the others at the trace's."""
    policy = make_policy(name, trace)
    if isinstance(policy, StaticPolicy):
        return policy.workers
    return min(trace.cluster.initial_workers, trace.cluster.gpu_slots)
