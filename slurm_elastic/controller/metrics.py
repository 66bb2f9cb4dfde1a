"""The controller's Prometheus metrics (``GET /metrics``): the queue, the controller, burst
jobs and, once the app is served, the API's connections.

Counts that only grow are typed ``counter`` (exposed as ``..._total``), levels ``gauge``, the
tick durations ``summary``. The
store's counts (delivered, dropped, lost, burst GPU-seconds) survive a controller restart; the
controller's own (ticks, heartbeats, refusals, closed connections) start again from 0, which
Prometheus' ``rate()`` reads as a counter reset."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from slurm_elastic.controller.connections import ConnectionBook
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.rollouts.queue import RolloutQueue

PREFIX = "slurm_elastic_"
CLOSED_REASONS = ("refused", "evicted", "stalled", "slow", "overpipelined", "head_too_large")


class _Snapshot(Collector):
    """Every metric from one reading of the queue, the controller and the connections."""

    def __init__(self, q: dict[str, Any], ctl: dict[str, Any], connections: ConnectionBook | None) -> None:
        self.q, self.ctl, self.connections = q, ctl, connections

    def collect(self) -> Iterator[Metric]:
        q, ctl = self.q, self.ctl
        burst, servers = ctl.get("burst") or {}, ctl.get("servers") or {}
        endpoints = servers.get("endpoints") or []
        for name, doc, value in [
            ("queued_sequences", "Sequences waiting in the rollout buffer", q["queued_sequences"]),
            ("buffer_capacity_sequences", "Bound of the rollout buffer", q["capacity_sequences"]),
            ("staleness_capacity_sequences", "Rollouts that may start now", q["staleness_capacity"]),
            ("policy_version", "Trainer policy version", q["policy_version"]),
            ("target_workers", "The worker count the controller steers to", ctl["target_workers"]),
            ("heartbeat_interval_seconds", "The interval workers are told to heart-beat at (longer in a large pool)",
             ctl["heartbeat_interval_s"]),
            ("heartbeat_senders", "Processes that heart-beat: each running step's wrapper, and its command's SDK once "
             "heard", ctl["heartbeat_senders"]),
            ("burst_jobs", "Burst jobs Slurm lists for this job (pending or running)", len(ctl.get("burst_jobs") or [])),
            ("cordoned_gpus", "Cordoned GPUs", len(ctl["cordoned_gpus"])),
            ("placeholders", "Steps holding cordoned GPUs (not workers)", ctl["placeholders"]),
            ("servers_routable", "Server workers in discovery (0 for rollout workers)", len(endpoints)),
            ("server_requests_outstanding", "Requests in flight at the servers, as the routers report them",
             sum(e.get("outstanding") or 0 for e in endpoints)),
            ("server_load_ratio", "Outstanding requests / (routable servers x requests_per_worker_capacity)",
             servers.get("load_ratio")),
            ("routers", "Routers that reported their load in the last 10 s", servers.get("routers")),
        ]:
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(value or 0))
        for name, doc, value in [
            ("delivered_sequences", "Sequences acknowledged by the trainer", q["delivered_sequences"]),
            ("dropped_stale_sequences", "Sequences dropped: too stale, or made past a version the trainer resumed at", q["dropped_stale_sequences"]),
            ("refused_submits", "Submits refused with 429 (backpressure)", q["refused_submits"]),
            ("refused_stale_sequences", "Sequences in submits refused as too stale", q["refused_stale_sequences"]),
            ("lost_groups", "Groups quarantined: damaged in the payload log, never delivered", q["lost_groups"]),
            ("lost_sequences", "Sequences in the groups quarantined as lost", q["lost_sequences"]),
            ("ticks", "Reconcile ticks done", ctl["ticks"]),
            ("heartbeats", "Worker heartbeats handled", ctl["heartbeats"]),
            ("tick_seconds", "Wall time of all reconcile ticks", ctl["tick_duration_s"]["total_s"]),
            ("burst_gpu_seconds_held", "GPU-seconds running burst jobs held", burst.get("gpu_s_held")),
            ("burst_gpu_seconds_used", "GPU-seconds workers had in burst jobs", burst.get("gpu_s_used")),
            ("burst_jobs_lost", "Burst jobs that ended unreleased (preempted, timed out, cancelled from outside)", burst.get("lost")),
            ("burst_jobs_requeued", "Running burst jobs Slurm put back in the queue (not lost: they wait again)", burst.get("requeued")),
        ]:
            yield CounterMetricFamily(PREFIX + name, doc, value=float(value or 0))
        workers = GaugeMetricFamily(PREFIX + "workers", "Workers by state", labels=["state"])
        for state, count in ctl["workers_by_state"].items():
            workers.add_metric([state], count)
        yield workers
        ticks = ctl["tick_duration_s"]
        tick = Metric(PREFIX + "tick_duration_seconds", "Reconcile tick wall time: quantiles of the last 60 ticks, "
                      "sum and count of all", "summary")
        for quantile, key in (("0.5", "p50"), ("0.95", "p95"), ("1", "max")):
            tick.add_sample(tick.name, {"quantile": quantile}, ticks[key])
        tick.add_sample(tick.name + "_sum", {}, ticks["total_s"])
        tick.add_sample(tick.name + "_count", {}, ticks["total_count"])
        yield tick
        yield GaugeMetricFamily(PREFIX + "controller_start_time_seconds",
                                "When this controller started (Unix time): its own counters count from then",
                                value=round(time.time() - ctl["uptime_s"]))
        if self.connections is not None:
            yield GaugeMetricFamily(PREFIX + "api_connections", "Open API connections",
                                    value=len(self.connections.open))
            closed = CounterMetricFamily(
                PREFIX + "api_connections_closed",
                "API connections the server closed: refused (every one busy), evicted (idle, to make room), "
                "stalled (response not read), slow (response read below the minimum rate), "
                "overpipelined (more requests queued than the server answers ahead), "
                "head_too_large (a request head over 64 KiB, answered 431)", labels=["reason"])
            for reason in CLOSED_REASONS:
                closed.add_metric([reason], getattr(self.connections, reason))
            yield closed


def metrics_registry(controller: Controller, queue: RolloutQueue, connections: ConnectionBook | None = None
                     ) -> CollectorRegistry:
    """A fresh registry per scrape with the current values (cheap: a few dozen series); with the
    server's ``connections``, its open connections and those it closed, by reason."""
    registry = CollectorRegistry()
    registry.register(_Snapshot(queue.stats(), controller.status(), connections))
    return registry
