"""The simulator's burst-job cluster model: capacity follows the burst decisions, GPU-hours count
what is held, and burst jobs buy back most of what a small allocation loses."""

from __future__ import annotations

import random
from pathlib import Path

from slurm_elastic.core.scaling import Decision, PressureInputs
from slurm_elastic.sim.burst_model import BurstCluster, BurstClusterSpec, compare_burst
from slurm_elastic.sim.output import load_trace

TRACES = Path(__file__).resolve().parents[2] / "examples" / "traces"


class Wants:
    def __init__(self, target: int) -> None:
        self.target = target

    def decide(self, x: PressureInputs, now_s: float) -> Decision:
        return Decision(self.target, "scale_up", "test")


def inputs(workers: int) -> PressureInputs:
    return PressureInputs(queued_seqs=0.0, batch_size=8, workers_active=workers, allowed_slots=100)


def test_capacity_arrives_after_the_queue_wait_and_goes_with_a_preemption() -> None:
    spec = BurstClusterSpec(allocation_slots=4, slots_per_job=4, max_jobs=2, submit_cooldown_s=0,
                            queue_wait_mean_s=100.0, preemptions_per_job_hour=0.0)
    wants = Wants(12)
    cluster = BurstCluster(wants, spec, random.Random(1))
    assert cluster.decide(inputs(4), 0.0).target_workers == 4  # two jobs submitted, both pending
    assert cluster.submissions == 2
    later = max(j.start_s for j in cluster.jobs) + 1
    assert cluster.decide(inputs(4), later).target_workers == 12
    cluster.jobs[0].preempt_s = later + 10
    assert cluster.decide(inputs(12), later + 10).target_workers == 8 and cluster.preemptions == 1
    assert cluster.submissions == 3  # the lost job is asked for again
    wants.target = 4  # pressure falls: the running job is released, then cancelled once empty
    assert cluster.decide(inputs(8), later + 20).target_workers == 4 and cluster.releasing
    cluster.decide(inputs(4), later + 30)
    assert all(j.end_s is not None for j in cluster.jobs) and not cluster.releasing
    held_s = cluster.gpu_seconds(later + 30)
    runs = [(j.start_s, j.end_s) for j in cluster.jobs]
    assert held_s == 4 * (later + 30) + 4 * sum(max(0.0, end - start) for start, end in runs if end is not None)


def test_on_a_trace_burst_jobs_hold_less_than_the_peak_and_idle_far_less_than_the_allocation_alone() -> None:
    trace = load_trace(TRACES / "steady.toml")
    result = compare_burst(trace, BurstClusterSpec(allocation_slots=4, slots_per_job=4, max_jobs=2,
                                                   queue_wait_mean_s=60.0), seed=0)
    held, idle = result.gpu_hours, result.trainer_idle_fraction
    assert held["allocation_only"] < held["allocation_plus_burst"] < held["static_peak"]
    assert idle["allocation_plus_burst"] < idle["allocation_only"] / 2
    assert abs(idle["allocation_plus_burst"] - idle["static_peak"]) < 0.05  # about the peak's, on fewer GPU-hours
    assert result.burst_jobs_submitted >= 1  # steady needs about 8: the allocation's 4 and a burst job's 4
