"""A cluster model for burst jobs in the simulator (pure; the clock and the randomness are the run's).

The job holds ``allocation_slots`` worker slots for the whole run; beyond them, capacity comes from
burst jobs decided by the controller's own :func:`~slurm_elastic.core.burst.decide_burst`. A
submitted job waits in Slurm's queue (exponential, mean ``queue_wait_mean_s``), then runs until
it is released and emptied, cancelled, or preempted (a Poisson process of
``preemptions_per_job_hour`` per running job). The model wraps the run's autoscaler policy: it
sees the policy's target, makes the burst decisions, and caps the target at the slots held now,
so the reconcile drains workers a preemption or a release takes away.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from dataclasses import dataclass, field

from slurm_elastic.core.burst import BurstJob, BurstPolicy, decide_burst
from slurm_elastic.core.scaling import Decision, PressureInputs
from slurm_elastic.sim.engine import Simulation
from slurm_elastic.sim.policies import Policy
from slurm_elastic.sim.trace import Trace


@dataclass(frozen=True)
class BurstClusterSpec:
    """The parent allocation and how the cluster treats burst jobs."""

    allocation_slots: int
    slots_per_job: int = 4
    max_jobs: int = 2
    submit_cooldown_s: float = 60.0
    queue_wait_mean_s: float = 120.0
    preemptions_per_job_hour: float = 0.0


@dataclass
class _Job:
    job_id: int
    submitted_s: float
    start_s: float  # when Slurm starts it (sampled at submission)
    preempt_s: float  # when it would be preempted once running (inf: never)
    end_s: float | None = None


@dataclass
class BurstCluster:
    """The policy wrapper that plays Slurm for burst jobs; read the counters after the run."""

    inner: Policy
    spec: BurstClusterSpec
    rng: random.Random
    jobs: list[_Job] = field(default_factory=list)
    releasing: set[int] = field(default_factory=set)
    last_submit_s: float | None = None
    preemptions: int = 0
    submissions: int = 0
    queue_wait_s: list[float] = field(default_factory=list)
    wanted: int | None = None  # the policy's last scale target: what burst jobs are asked for

    def decide(self, x: PressureInputs, now_s: float) -> Decision:
        for job in self.jobs:
            if job.end_s is None and now_s >= job.start_s and now_s >= job.preempt_s:
                job.end_s = job.preempt_s
                self.preemptions += 1
        decision = self.inner.decide(x, now_s)
        pool = x.workers_starting + x.workers_active + x.workers_draining
        if decision.action != "hold" or self.wanted is None:  # a hold keeps the count steered to
            self.wanted = decision.target_workers
        policy = BurstPolicy(self.spec.max_jobs, self.spec.slots_per_job, self.spec.submit_cooldown_s)
        jobs = self._core_jobs(now_s, pool)
        burst = decide_burst(policy, target_workers=self.wanted, allocation_slots=self.spec.allocation_slots,
                             jobs=jobs, releasing=frozenset(self.releasing), last_submit_s=self.last_submit_s,
                             now_s=now_s)
        by_id = {j.job_id: j for j in self.jobs}
        for job_id in burst.cancel:
            job = by_id[job_id]
            job.end_s = now_s if now_s >= job.start_s else job.submitted_s  # a pending one never held GPUs
            self.releasing.discard(job_id)
        self.releasing -= set(burst.keep)
        self.releasing |= set(burst.release)
        for _ in range(burst.submit):
            self._submit(now_s)
        return dataclasses.replace(decision, target_workers=min(self.wanted, self.slots_held(now_s)))

    def slots_held(self, now_s: float) -> int:
        """Slots the pool may fill now: the allocation's and those of running jobs not being released."""
        return self.spec.allocation_slots + self.spec.slots_per_job * sum(
            1 for j in self._running(now_s) if j.job_id not in self.releasing)

    def gpu_seconds(self, end_s: float) -> float:
        """Slot-seconds held over ``[0, end_s]``: the allocation's, and each burst job's while it ran."""
        burst_s = sum(max(0.0, min(j.end_s if j.end_s is not None else end_s, end_s) - j.start_s)
                      for j in self.jobs if j.start_s < end_s)
        return self.spec.allocation_slots * end_s + self.spec.slots_per_job * burst_s

    def _running(self, now_s: float) -> list[_Job]:
        return [j for j in self.jobs if j.end_s is None and j.start_s <= now_s]

    def _core_jobs(self, now_s: float, pool: int) -> tuple[BurstJob, ...]:
        """Jobs as the controller sees them; workers fill the allocation first, then jobs in order."""
        left = max(0, pool - self.spec.allocation_slots)
        core = []
        for job in self.jobs:
            if job.end_s is not None:
                continue
            if job.start_s > now_s:
                core.append(BurstJob(job.job_id, "PENDING", self.spec.slots_per_job, expected_start_s=job.start_s))
                continue
            workers = min(left, self.spec.slots_per_job)
            left -= workers
            core.append(BurstJob(job.job_id, "RUNNING", self.spec.slots_per_job, workers=workers))
        return tuple(core)

    def _submit(self, now_s: float) -> None:
        wait_s = self.rng.expovariate(1.0 / self.spec.queue_wait_mean_s) if self.spec.queue_wait_mean_s > 0 else 0.0
        rate_per_s = self.spec.preemptions_per_job_hour / 3600.0
        run_s = self.rng.expovariate(rate_per_s) if rate_per_s > 0 else float("inf")
        self.submissions += 1
        self.queue_wait_s.append(wait_s)
        self.jobs.append(_Job(self.submissions, now_s, now_s + wait_s, now_s + wait_s + run_s))
        self.last_submit_s = now_s


@dataclass(frozen=True)
class BurstComparison:
    """One trace: a static allocation sized for the peak, the allocation alone, and the allocation with burst jobs."""

    trace: str
    peak_slots: int
    allocation_slots: int
    duration_s: float
    gpu_hours: dict[str, float]  # held, per setting
    static_peak_used_gpu_hours: float  # what the workers in the peak-sized allocation used of it
    trainer_idle_fraction: dict[str, float]
    preemptions: int
    burst_jobs_submitted: int
    mean_queue_wait_s: float


def compare_burst(trace: Trace, spec: BurstClusterSpec, seed: int | None = None) -> BurstComparison:
    """Run ``trace`` three ways with the controller's policy: in a static allocation of the trace's
    ``gpu_slots`` (the peak), in ``spec.allocation_slots`` alone, and in that allocation with burst jobs."""
    peak = trace.cluster.gpu_slots
    peak_run = Simulation(trace, "ours", seed).run()
    small = dataclasses.replace(trace, cluster=dataclasses.replace(trace.cluster, gpu_slots=spec.allocation_slots))
    small_run = Simulation(small, "ours", seed).run()
    wide = dataclasses.replace(trace, cluster=dataclasses.replace(
        trace.cluster, gpu_slots=spec.allocation_slots + spec.max_jobs * spec.slots_per_job))
    sim = Simulation(wide, "ours", seed)
    cluster = BurstCluster(sim.seat.policy, spec, random.Random(zlib.crc32(f"{trace.name}:{sim.seed}".encode())))
    sim.seat.policy = cluster
    burst_run = sim.run()
    end_s = trace.duration_s
    hours = 3600.0
    return BurstComparison(
        trace=trace.name, peak_slots=peak, allocation_slots=spec.allocation_slots, duration_s=end_s,
        gpu_hours={"static_peak": peak * end_s / hours, "allocation_only": spec.allocation_slots * end_s / hours,
                   "allocation_plus_burst": cluster.gpu_seconds(end_s) / hours},
        trainer_idle_fraction={"static_peak": peak_run.metrics["trainer_idle_fraction"],
                               "allocation_only": small_run.metrics["trainer_idle_fraction"],
                               "allocation_plus_burst": burst_run.metrics["trainer_idle_fraction"]},
        static_peak_used_gpu_hours=peak_run.metrics["gpu_seconds"] / hours,
        preemptions=cluster.preemptions, burst_jobs_submitted=cluster.submissions,
        mean_queue_wait_s=sum(cluster.queue_wait_s) / len(cluster.queue_wait_s) if cluster.queue_wait_s else 0.0,
    )
