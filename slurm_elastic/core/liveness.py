"""Liveness of ready servers: when a server that failed its probes leaves discovery and drains.

The worker wrapper on the server's node probes the server after it turned ready and reports its
consecutive failed probes with each heartbeat; this module decides (pure, time passed in). A server
at ``failure_threshold`` failures goes DRAINING at once: it leaves discovery, its drain signal
follows as for any server drain, and the target count launches a replacement.
"""

from __future__ import annotations

from collections.abc import Iterable

from slurm_elastic.core.lifecycle import Worker, WorkerState, begin_drain

S = WorkerState


def not_live_reason(worker: Worker, failure_threshold: int) -> str:
    """Why ``worker`` counts as not live (its failed probes reached the threshold); "" if it is live.

    A threshold of 0 turns the check off; only ACTIVE servers (not placeholders) are judged."""
    if (failure_threshold <= 0 or worker.state is not S.ACTIVE or worker.placeholder
            or worker.liveness_failures < failure_threshold):
        return ""
    return f"not live: {worker.liveness_failures} failed liveness probes in a row (threshold {failure_threshold})"


def drain_not_live(workers: Iterable[Worker], failure_threshold: int, now_s: float) -> list[Worker]:
    """Move every not-live worker to DRAINING (out of discovery, replaced); returns them."""
    drained = []
    for worker in workers:
        if reason := not_live_reason(worker, failure_threshold):
            begin_drain(worker, now_s, reason)
            drained.append(worker)
    return drained
