"""A worker's speed from its heartbeats (seconds per rollout, which workers are clearly slow), and
the order a scale-down drains workers in (pure).

A scale-down drains clearly slow workers early (an older or throttled GPU); time its job stood
still (``scontrol suspend``) inside a rollout is not its speed.
"""

from __future__ import annotations

import statistics

from slurm_elastic.core.lifecycle import Worker, WorkerState

SLOW_FACTOR = 1.3  # a worker whose rollouts take this much longer than the median worker's drains first
SLOW_MIN_ROLLOUTS = 4  # ... once it has finished this many (fewer say more of the prompts than of its GPU)


def note_busy_s(worker: Worker, busy_s: float, running_s: float | None = None, stopped_s: float = 0.0) -> None:
    """A heartbeat's cumulative seconds inside rollouts, as its step's SDK counts them: with a
    monotonic clock, which runs on while the job is stopped (``scontrol suspend``). Since its last
    heartbeat the worker ran ``running_s`` and was stopped ``stopped_s``; what its count grew by past
    ``running_s`` (at most ``stopped_s``) is stopped time inside a rollout: kept in
    ``paused_busy_s``, not its speed. A count lower than the last is its SDK counting from 0 again
    (its stopped time with it)."""
    increase_s = busy_s - worker.busy_s
    if increase_s < 0:
        worker.paused_busy_s, increase_s = 0.0, busy_s
    if stopped_s > 0 and running_s is not None:
        worker.paused_busy_s += min(stopped_s, max(0.0, increase_s - max(0.0, running_s)))
    worker.busy_s = busy_s


def seconds_per_rollout(worker: Worker) -> float | None:
    """Its current step's mean seconds inside one rollout (the one in flight counts as one; time its
    job was stopped does not), or None before it has finished ``SLOW_MIN_ROLLOUTS``."""
    busy_s = worker.busy_s - worker.paused_busy_s
    if worker.state is not WorkerState.ACTIVE or worker.rollouts < SLOW_MIN_ROLLOUTS or busy_s <= 0:
        return None
    return busy_s / (worker.rollouts + (1 if worker.busy else 0))


def slow_workers(workers: list[Worker]) -> dict[str, float]:
    """The workers whose mean rollout takes over ``SLOW_FACTOR`` times the median worker's (an
    older or throttled GPU), with their seconds per rollout; needs three measured workers."""
    measured = {w.worker_id: s for w in workers if (s := seconds_per_rollout(w)) is not None}
    if len(measured) < 3:
        return {}
    median_s = statistics.median(measured.values())
    return {worker_id: s for worker_id, s in measured.items() if s > SLOW_FACTOR * median_s}


def drain_order(capacity: list[Worker], first_jobs: frozenset[int] = frozenset(),
                cordoned: frozenset[tuple[str, int]] = frozenset()) -> list[Worker]:
    """Workers in ``first_jobs`` first; then least useful first: pending relaunches, not-yet-running,
    those kept on a cordoned GPU, clearly slow ones (slowest first, :func:`slow_workers`), idle, then
    busy; newest first within each."""
    slow = slow_workers(capacity)

    def rank(worker: Worker) -> tuple[int, int, float, tuple[int, str]]:
        if worker.state is WorkerState.BACKOFF:
            group = 0
        elif worker.state is WorkerState.STARTING:
            group = 1
        elif worker.cordoned_gpus(cordoned):
            group = 2
        elif worker.worker_id in slow:
            group = 3
        elif not worker.busy:
            group = 4
        else:
            group = 5
        newest_id = (-int(worker.worker_id), "") if worker.worker_id.isdigit() else (0, worker.worker_id)
        order_s = -slow[worker.worker_id] if worker.worker_id in slow else -worker.launched_at_s
        return 0 if worker.job_id in first_jobs else 1, group, order_s, newest_id

    return sorted(capacity, key=rank)
