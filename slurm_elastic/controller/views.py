"""What the controller shows: the status (/global-status, ``slurm-elastic status``), one row per
worker, the servers' load, and the loop's own timing."""

from __future__ import annotations

import statistics
import time
from typing import Any

from slurm_elastic.controller.base import ERROR_LIMIT, ControllerBase
from slurm_elastic.core.lifecycle import Worker, WorkerState
from slurm_elastic.core.speed import seconds_per_rollout, slow_workers

S = WorkerState
ENDED_SHOWN = 5  # the workers that ended last, in status


class StatusViews(ControllerBase):
    def status(self) -> dict[str, Any]:
        """Controller fields for /global-status and ``slurm-elastic status``, with the queue's numbers."""
        queue = self.queue.stats() if self.queue is not None else None  # outside our lock: the queue has its own
        with self.lock:
            now_s = self.clock()
            st = self.state
            by_state = {s.value: 0 for s in WorkerState}
            slow = slow_workers([w for w in st.workers.values() if w.counts_as_capacity])
            for worker in st.workers.values():
                if not (worker.placeholder and worker.has_step):  # a step holding a cordoned GPU is no worker
                    by_state[worker.state.value] += 1
            return {
                "job_id": self.job_id,
                "controller_url": self.controller_url,
                "now_s": round(now_s, 3),
                "uptime_s": round(now_s - self.started_at_s, 1),
                "ticks": self.ticks,
                "tick_duration_s": self.tick_duration_summary(),
                "heartbeats": self.heartbeats,
                "heartbeat_interval_s": self.heartbeat_interval_s,
                "heartbeat_senders": self.heartbeat_senders,
                "target_workers": st.target_workers,
                "usable_slots": self.usable_slots,
                "paused": st.paused,
                "manual_target": st.manual_target,
                "wake_all": st.wake_all_active,
                "last_decision": st.last_decision,
                "time_limit_in_s": None if self.job_times_s is None else round(self.job_times_s[1] - time.time(), 1),
                "workers_by_state": by_state,
                "placeholders": sum(1 for w in st.workers.values() if w.placeholder and w.has_step),
                "workers": [self._worker_view(w, now_s, slow) for w in sorted(st.workers.values(), key=lambda w: w.worker_id)
                            if w.state is not S.INACTIVE],
                "ended_workers": self._ended_view(now_s),
                "cordoned_gpus": [{"node": n, "gpu": g, **v} for (n, g), v in sorted(self.cordoned_gpus().items())],
                "unknown_health_nodes": sorted(self.unknown_nodes(now_s)),
                "agent_errors": {node: list(errors) for node, errors in sorted(self.agent_errors.items())},
                "left_nodes": list(self.left_nodes),
                "servers": self._servers_view(now_s) if self.is_server else None,
                "weights": self.weights.view(),
                "errors": self.errors[-ERROR_LIMIT:],
                "state_note": "; ".join(self.state_notes),
                "state_notes": list(self.state_notes),
                "queue": queue,
                **self._burst_view(),
            }

    def _ended_view(self, now_s: float) -> list[dict[str, Any]]:
        """The workers that ended last (INACTIVE, newest first, at most ENDED_SHOWN): when, where, why."""
        ended = sorted((w for w in self.state.workers.values() if w.state is S.INACTIVE and w.history),
                       key=lambda w: w.history[-1][0], reverse=True)[:ENDED_SHOWN]
        return [{"worker_id": w.worker_id, "node": w.node, "gpus": list(w.gpus), "rollouts": w.rollouts,
                 "ended_s_ago": round(now_s - w.history[-1][0], 1), "reason": _why_ended(w)} for w in ended]

    def _burst_view(self) -> dict[str, Any]:
        """Burst jobs (docs/burst.md): one row per job, and what they held and the pool used of it."""
        if self.burst is None:
            return {}
        live: dict[int, int] = {}
        for worker in self.state.workers.values():
            if worker.keeps_step:  # a suspended job's stopped workers too
                live[worker.job_id] = live.get(worker.job_id, 0) + 1
        c = self.burst.counters
        return {"burst_jobs": self.burst.status_rows(live),
                "burst": {"submitted": c.submitted, "cancelled": c.cancelled, "lost": c.lost,
                          "requeued": c.requeued, "gpu_s_held": round(c.gpu_s_held, 1), "gpu_s_used": round(c.gpu_s_used, 1),
                          "last_decision": self.burst.last_decision.reason, "errors": c.errors[-3:]}}

    def tick_duration_summary(self) -> dict[str, float | int]:
        """Wall time of the last ``TICK_WINDOW`` ticks (observe + decide + act + persist): p50, p95, max,
        how many; and ``total_s``, the time of all ``total_count`` ticks so far (a window's mean: delta
        total_s / delta total_count)."""
        recent = sorted(self.tick_durations_s)
        if not recent:
            return {"p50": 0.0, "p95": 0.0, "max": 0.0, "count": 0, "total_s": 0.0, "total_count": 0}
        p95 = recent[min(len(recent) - 1, round(0.95 * (len(recent) - 1)))]
        return {"p50": round(statistics.median(recent), 4), "p95": round(p95, 4), "max": round(recent[-1], 4),
                "count": len(recent), "total_s": round(self.tick_total_s, 4), "total_count": self.tick_total_count}

    def _servers_view(self, now_s: float) -> dict[str, Any]:
        capacity = self.state.autoscaler.config.requests_per_worker_capacity
        view = self.endpoints.view(now_s)
        view["load_ratio"] = self.endpoints.load_ratio(capacity, now_s)
        view["requests_per_worker_capacity"] = capacity
        return view

    def _worker_view(self, worker: Worker, now_s: float, slow: dict[str, float]) -> dict[str, Any]:
        per_rollout_s = seconds_per_rollout(worker)
        return {
            "worker_id": worker.worker_id, "job_id": worker.job_id or self.job_id, "state": worker.state.value,
            "step_id": worker.step_id, "node": worker.node, "gpus": list(worker.gpus), "nodes": list(worker.all_nodes),
            "node_gpus": {n: list(g) for n, g in worker.node_gpus.items()}, "age_s": round(now_s - worker.launched_at_s, 1),
            "rollouts": worker.rollouts, "busy": worker.busy, "placeholder": worker.placeholder,
            "seconds_per_rollout": None if per_rollout_s is None else round(per_rollout_s, 2),
            "slow": worker.worker_id in slow,  # drained first at a scale-down
            "last_heartbeat_age_s": round(now_s - worker.last_heartbeat_s, 1), "crash_count": worker.crash_count,
            "launches": worker.launches, "endpoint": worker.endpoint, "liveness_failures": worker.liveness_failures,
            "outstanding_requests": self.endpoints.outstanding(worker.worker_id, now_s) if self.is_server else None,
            "weights_version": worker.weights_version, **self.weights.server_view(worker.worker_id),
            "history": [list(h) for h in worker.history[-10:]],
        }


def _why_ended(worker: Worker) -> str:
    """Why an INACTIVE worker ended: the reason it was drained for, else its last transition's."""
    _at, left, _to, last = worker.history[-1]
    if left != S.DRAINING.value:
        return last
    drained_for = next((why for _t, _f, to, why in reversed(worker.history) if to == S.DRAINING.value), "")
    return f"drained ({drained_for}); {last}" if drained_for else last
