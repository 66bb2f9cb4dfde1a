"""Inference servers' load as a worker count (pure).

The load ratio L = outstanding / (active · capacity), with ``capacity`` the requests one server
holds at once (``requests_per_worker_capacity``). Inside [scale_down_threshold,
scale_up_threshold] it recommends the current count; outside, ceil(outstanding / (capacity ·
scale_up_threshold)) servers. The autoscaler takes the larger of this and the rollout pressure's
recommendation when both exist (core.scaling).
"""

from __future__ import annotations

import math

from slurm_elastic.core.autoscaler_config import AutoscalerConfig


def load_recommendation(cfg: AutoscalerConfig, outstanding_requests: int | None, workers_active: int,
                        current: int) -> tuple[float | None, str]:
    """The servers the load ratio asks for, and why; None without a load measurement."""
    if outstanding_requests is None:
        return None, ""
    capacity = cfg.requests_per_worker_capacity
    ratio = outstanding_requests / max(1, workers_active) / capacity
    if cfg.scale_down_threshold <= ratio <= cfg.scale_up_threshold:
        return float(current), f"load ratio {ratio:.2f} within [{cfg.scale_down_threshold}, {cfg.scale_up_threshold}]"
    need = math.ceil(outstanding_requests / (capacity * cfg.scale_up_threshold))
    word = "above" if ratio > cfg.scale_up_threshold else "below"
    return float(need), (f"load ratio {ratio:.2f} {word} threshold: {outstanding_requests} outstanding / "
                         f"{capacity:g} per server -> {need} servers")
