"""The controller's Prometheus metrics (``GET /metrics``): the queue, the controller, burst
jobs and, once the app is served, the API's connections."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from slurm_elastic.controller.connections import ConnectionBook
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.rollouts.queue import RolloutQueue


def metrics_registry(controller: Controller, queue: RolloutQueue, connections: ConnectionBook | None = None
                     ) -> CollectorRegistry:
    """A fresh registry per scrape with the current values (cheap: a dozen gauges); with the
    server's ``connections``, its open connections and those it closed, by reason."""
    registry = CollectorRegistry()
    q = queue.stats()
    ctl = controller.status()
    burst = ctl.get("burst") or {}
    for name, doc, value in [
        ("queued_sequences", "Sequences waiting in the rollout buffer", q["queued_sequences"]),
        ("buffer_capacity_sequences", "Bound of the rollout buffer", q["capacity_sequences"]),
        ("staleness_capacity_sequences", "Rollouts that may start now", q["staleness_capacity"]),
        ("policy_version", "Trainer policy version", q["policy_version"]),
        ("delivered_sequences_total", "Sequences acknowledged by the trainer", q["delivered_sequences"]),
        ("dropped_stale_sequences_total", "Sequences dropped as too stale", q["dropped_stale_sequences"]),
        ("refused_submits_total", "Submits refused with 429 (backpressure)", q["refused_submits"]),
        ("refused_stale_sequences_total", "Sequences in submits refused as too stale", q["refused_stale_sequences"]),
        ("lost_groups_total", "Groups quarantined: damaged in the payload log, never delivered", q["lost_groups"]),
        ("lost_sequences_total", "Sequences in the groups quarantined as lost", q["lost_sequences"]),
        ("target_workers", "The worker count the controller steers to", ctl["target_workers"]),
        ("ticks_total", "Reconcile ticks done", ctl["ticks"]),
        ("heartbeats_total", "Worker heartbeats handled", ctl["heartbeats"]),
        ("tick_seconds_total", "Wall time of all reconcile ticks", ctl["tick_duration_s"]["total_s"]),
        ("burst_jobs", "Burst jobs Slurm lists for this job (pending or running)", len(ctl.get("burst_jobs") or [])),
        ("burst_gpu_seconds_held_total", "GPU-seconds running burst jobs held", burst.get("gpu_s_held")),
        ("burst_gpu_seconds_used_total", "GPU-seconds workers had in burst jobs", burst.get("gpu_s_used")),
        ("burst_jobs_lost_total", "Burst jobs that ended unreleased (preempted, timed out)", burst.get("lost")),
    ]:
        Gauge(f"slurm_elastic_{name}", doc, registry=registry).set(float(value or 0))
    workers = Gauge("slurm_elastic_workers", "Workers by state", ["state"], registry=registry)
    for state, count in ctl["workers_by_state"].items():
        workers.labels(state=state).set(count)
    tick = Gauge("slurm_elastic_tick_duration_seconds", "Recent reconcile tick wall time", ["quantile"],
                 registry=registry)
    for quantile, key in (("0.5", "p50"), ("0.95", "p95"), ("1", "max")):
        tick.labels(quantile=quantile).set(ctl["tick_duration_s"][key])
    Gauge("slurm_elastic_cordoned_gpus", "Cordoned GPUs", registry=registry).set(len(ctl["cordoned_gpus"]))
    Gauge("slurm_elastic_placeholders", "Steps holding cordoned GPUs (not workers)", registry=registry).set(
        ctl["placeholders"])
    if connections is not None:
        Gauge("slurm_elastic_api_connections", "Open API connections", registry=registry).set(len(connections.open))
        closed = Gauge("slurm_elastic_api_connections_closed_total",
                       "API connections the server closed: refused (every one busy), evicted (idle, to make room), "
                       "stalled (response not read), slow (response read below the minimum rate)", ["reason"],
                       registry=registry)
        for reason in ("refused", "evicted", "stalled", "slow"):
            closed.labels(reason=reason).set(getattr(connections, reason))
    return registry
