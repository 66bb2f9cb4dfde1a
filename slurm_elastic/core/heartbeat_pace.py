"""How often a worker heart-beats in a pool of a given size (pure).

Each heartbeat costs the controller about a millisecond of CPU, nearly all of it the HTTP request
(``bench/bench_heartbeat_cost.py``), so the heartbeats per second, not the pool's size, set the
controller's load. Every running step's wrapper beats, and so does the worker SDK in each task
of a step whose command uses it. Up to ``max_per_s * interval_s`` such senders beat every
``interval_s``; more beat just slowly enough to keep to ``max_per_s`` together, but never slower
than a quarter of the grace, so a silent worker is still told from a live one by four missed
heartbeats at least (past that size the rate grows again).
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable

from slurm_elastic.core.defaults import LONGEST_HEARTBEAT_INTERVAL_S
from slurm_elastic.core.lifecycle import Worker

GRACE_BEATS = 4  # heartbeats a live worker sends within workers.heartbeat_grace_s, at the slowest pace


def heartbeat_senders(workers: Iterable[Worker], sdk_worker_ids: Container[str], tasks_per_step: int) -> int:
    """The processes that heart-beat: the wrapper of each worker whose step runs, and the SDK in each
    of the ``tasks_per_step`` tasks of a worker in ``sdk_worker_ids`` (its SDK has beaten)."""
    return sum(1 + (tasks_per_step if w.worker_id in sdk_worker_ids else 0) for w in workers if w.has_step)


def heartbeat_interval_s(senders: int, interval_s: float, max_per_s: float, grace_s: float) -> float:
    """The interval the controller asks its workers to beat at: ``interval_s``
    (``workers.heartbeat_interval_s``) or, for more than ``max_per_s * interval_s`` senders,
    ``senders / max_per_s`` rounded up to a tenth of a second, at most ``grace_s / 4`` (and never
    below ``interval_s``; at most an hour)."""
    longest_s = min(grace_s / GRACE_BEATS, LONGEST_HEARTBEAT_INTERVAL_S)
    stretched_s = math.ceil(round(10 * min(senders / max_per_s, longest_s), 6)) / 10  # clamped first: no overflow
    return max(interval_s, min(stretched_s, longest_s))


def longest_heartbeat_interval_s(interval_s: float, grace_s: float) -> float:
    """The longest interval :func:`heartbeat_interval_s` tells, however many senders."""
    return max(interval_s, min(grace_s / GRACE_BEATS, LONGEST_HEARTBEAT_INTERVAL_S))
