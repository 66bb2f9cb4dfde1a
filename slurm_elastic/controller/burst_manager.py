"""Burst jobs, tick by tick: observe them (one ``squeue``), decide with the core, act through Slurm.

Slurm holds all the state: which jobs exist (name and comment), which run, and which are being
emptied (the comment's ``released`` mark), so a restarted controller adopts its burst jobs from
the first listing and duplicates none. What the manager keeps in memory is only derived: the GPU
indexes of running jobs (read once per job), the comment it last gave each job (one that someone
overwrote is set back), the time of the last submission, counters.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from slurm_elastic.controller.burst_jobs import BurstJobs, core_jobs
from slurm_elastic.core.burst import (
    SUSPENDED_STATES,
    BurstDecision,
    BurstJob,
    BurstPolicy,
    as_judged,
    burst_job_comment,
    burst_phase,
    decide_burst,
    is_released_comment,
    on_hold,
    pending_lost,
    processes_may_run,
    run_outcomes,
)
from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.parse import QueuedJob

log = logging.getLogger(__name__)
JOB_FINISHED = "Job has already finished"  # scontrol update's answer for a job that is completing


@dataclass
class BurstCounters:
    """What burst jobs did so far (status and /metrics)."""

    submitted: int = 0
    cancelled: int = 0  # given back by this controller (a job is counted cancelled or lost, never both)
    lost: int = 0  # ended while running without being released: preempted, timed out, cancelled by others
    requeued: int = 0  # put back in the queue by Slurm while running (same job id, pending again): not lost
    gpu_s_held: float = 0.0  # GPU-seconds burst jobs held while running
    gpu_s_used: float = 0.0  # of those, GPU-seconds the pool's workers had in them
    errors: list[str] = field(default_factory=list)


class BurstManager:
    """The burst jobs of one parent job."""

    def __init__(self, jobs: BurstJobs, policy: BurstPolicy, gpus_per_worker: int,
                 suspended_limit_s: float = 600.0) -> None:
        self.jobs = jobs
        self.policy = policy
        self.gpus_per_worker = gpus_per_worker
        self.listed: list[QueuedJob] = []
        self.last_submit_s: float | None = None
        self.last_decision = BurstDecision(reason="burst: not decided yet")
        self.counters = BurstCounters()
        self._gpus: dict[int, dict[str, tuple[int, ...]]] = {}
        self._ran: frozenset[int] = frozenset()  # jobs whose run was not over at the last listing
        self._pending: frozenset[int] = frozenset()  # jobs pending at the last listing
        self._last_seen_s: float | None = None
        self._ending: set[int] = set()
        self._signalled: set[int] = set()  # of those, jobs Slurm's drain signal reached: lost when their run ends
        self._given_back: set[int] = set()  # jobs this controller cancelled or released: not lost when they end
        self._completing_since_s: dict[int, float] = {}  # jobs listed COMPLETING: when first seen so
        self.suspended_limit_s = suspended_limit_s  # the admission TTL: a job suspended longer is given back
        self._suspended_since_s: dict[int, float] = {}  # jobs listed suspended: when first seen so
        self._counted_cancelled: set[int] = set()  # jobs counted in counters.cancelled (while Slurm lists them)
        self._comments: dict[int, str] = {}  # job -> the comment this controller submitted, adopted or set
        self._refusals: dict[tuple[int, str], str] = {}  # (job, "name"/"comment") -> why Slurm refused to set it back
        self._script_checked = False  # the jobs running this parent's burst script were looked for
        self.listed_now = False  # this tick's listing worked: only then does :meth:`step` decide

    # ---- observe -------------------------------------------------------------------------------
    def observe(self) -> bool:
        """List the burst jobs (one call); on failure keep the last view. Returns whether it worked."""
        try:
            named = self.jobs.named()
            if not self._script_checked:
                self._adopt_by_script()
            renamed = self._renamed({j.job_id for j in named})
        except SlurmError as exc:
            self._error(f"listing burst jobs failed: {exc}")
            self.listed_now = False
            return False
        self.listed = [self._own(j) for j in sorted(named + renamed, key=lambda j: j.job_id)
                       if self.jobs.is_ours(j) or j.job_id in self._comments]
        known = {j.job_id for j in self.listed}
        running = {j.job_id for j in self.listed if j.state == "RUNNING"}  # a requeued job's GPUs are read anew
        self._gpus = {k: v for k, v in self._gpus.items() if k in running}
        self._comments = {k: v for k, v in self._comments.items() if k in known}
        self.listed_now = True
        return True

    def _adopt_by_script(self) -> None:
        """At this controller's first listing: a job running this parent's burst script is one of its
        burst jobs even if someone changed its name or comment before this controller started
        (Slurm lets no one change a job's command); it is adopted, and the next steps set both back."""
        for job in self.jobs.running_the_script():
            if job.job_id not in self._comments and burst_phase(job.state) != "ENDED":
                ours = self.jobs.is_ours(job)
                self._comments[job.job_id] = job.comment if ours else burst_job_comment(self.jobs.parent_job_id)
        self._script_checked = True

    def _renamed(self, named_ids: set[int]) -> list[QueuedJob]:
        """This controller's jobs missing from the listing by name that Slurm still runs or queues:
        someone renamed them (``scontrol update JobId=B JobName=...``); their name is set back, as
        the listing, the epilog and a restarted controller find burst jobs by it. One squeue call,
        made only when a known job is missing (most often: it ended)."""
        missing = set(self._comments) - named_ids
        if not missing:
            return []
        found = [j for j in self.jobs.by_ids(missing) if burst_phase(j.state) != "ENDED"]
        for job in found:
            self._set_back(job.job_id, "name", job.name, self.jobs.name, partial(self.jobs.set_name, job.job_id))
        return [replace(j, name=self.jobs.name) for j in found]

    def _own(self, job: QueuedJob) -> QueuedJob:
        """A job of this parent as listed: its comment recorded, or set back to the recorded one
        when someone overwrote it (``scontrol update ... Comment=``): the epilog, ``stop`` and a
        restarted controller find burst jobs by that comment."""
        if self.jobs.is_ours(job):
            self._comments[job.job_id] = job.comment
            return job
        wanted = self._comments[job.job_id]
        self._set_back(job.job_id, "comment", job.comment, wanted, partial(self.jobs.set_comment, job.job_id, wanted))
        return replace(job, comment=wanted)

    def _set_back(self, job_id: int, what: str, found: str, wanted: str, set_it: Callable[[], None]) -> None:
        """Set a burst job's name or comment, which someone changed to ``found``, back to ``wanted``:
        the controller, the epilog and ``stop`` find burst jobs by both. A refusal is said once, not
        at every tick."""
        try:
            set_it()
        except SlurmError as exc:
            if self._refusals.get((job_id, what)) != str(exc):
                self._refusals[(job_id, what)] = str(exc)
                self._error(f"setting burst job {job_id}'s {what} back to {wanted!r} failed: {exc}")
            return
        self._refusals.pop((job_id, what), None)
        log.warning("burst job %d's Slurm %s read %r; set back to %r, by which the controller, the epilog and "
                    "`slurm-elastic stop` find it", job_id, what, found, wanted)

    @property
    def suspended(self) -> frozenset[int]:
        """Jobs listed SUSPENDED (or STOPPED: ``scancel --signal=STOP``) at the last listing: their
        workers' steps are stopped."""
        return frozenset(j.job_id for j in self.listed if j.state in SUSPENDED_STATES)

    @property
    def alive(self) -> frozenset[int] | None:
        """Jobs whose processes may still run or stand stopped (running, suspended, completing) at
        this tick's listing; None when it failed (a job missing from the last view may still run)."""
        return frozenset(j.job_id for j in self.listed if processes_may_run(j.state)) if self.listed_now else None

    @property
    def releasing(self) -> frozenset[int]:
        """Jobs being emptied: marked so in Slurm, or ending (preempted, at their time limit)."""
        return frozenset(j.job_id for j in self.listed if is_released_comment(j.comment)) | self._ending

    @property
    def jobs_on_hold(self) -> int:
        """Pending jobs that wait on a hold at the last listing: they take a place of ``max_jobs``
        and will bring nothing until released."""
        return sum(on_hold(j.state, j.reason) for j in self.listed)

    def held_nodes(self) -> set[str]:
        """The nodes of the burst jobs running at the last listing whose GPUs were read (no Slurm call)."""
        return {node for job in self.listed if job.state == "RUNNING" for node in self._gpus.get(job.job_id, {})}

    def running_gpus(self) -> dict[int, dict[str, tuple[int, ...]]]:
        """Running burst jobs -> their GPUs per node (read once per job). Released ones included:
        their workers still run there; placement must leave them out of new launches."""
        out: dict[int, dict[str, tuple[int, ...]]] = {}
        for job in self.listed:
            if job.state != "RUNNING":
                continue
            if job.job_id not in self._gpus:
                try:
                    self._gpus[job.job_id] = self.jobs.gpus_by_node(job.job_id)
                except SlurmError as exc:
                    self._error(f"reading the GPUs of burst job {job.job_id} failed: {exc}")
                    continue
            out[job.job_id] = self._gpus[job.job_id]
        return out

    # ---- decide and act ------------------------------------------------------------------------
    def step(self, *, target_workers: int, allocation_slots: int, workers_by_job: Mapping[int, int],
             draining_by_job: Mapping[int, int], now_s: float, ending_jobs: frozenset[int] = frozenset(),
             out_of_use_jobs: frozenset[int] = frozenset(), exclude_nodes: tuple[str, ...] = ()) -> BurstDecision:
        """Decide with the core and act: submit, cancel, mark released (or needed again).

        ``ending_jobs``: burst jobs whose workers left on their own (Slurm signalled a preemption,
        the time limit or a requeue); ``out_of_use_jobs``: running ones none of whose GPUs can take a
        worker (Slurm marks their nodes out of use, or every GPU is cordoned). Both are released for
        good and cancelled once empty; the pool may ask for another, not on ``exclude_nodes``. A
        running job listed pending again was requeued: counted so, kept as a pending job."""
        listed_ids = {j.job_id for j in self.listed}
        current = core_jobs(self.listed, self.policy.worker_slots_per_job, workers_by_job, draining_by_job)
        runs = run_outcomes(self._ran, current, frozenset(self._given_back - self._signalled))
        for job_id in runs.lost:
            log.warning("burst job %d ended before it was given back (preempted, timed out, or cancelled from "
                        "outside): counted lost", job_id)
        self.counters.lost += len(runs.lost)
        for job_id in runs.requeued:
            self._requeued(job_id)
        self._ran = runs.running
        never_ran = pending_lost(self._pending, current, frozenset(self._given_back))
        for job_id in never_ran:
            log.warning("burst job %d ended before it ran, not cancelled by this controller (cancelled from "
                        "outside, or refused by Slurm): counted lost", job_id)
        self.counters.lost += len(never_ran)
        self._pending = frozenset(j.job_id for j in current if (j.phase == "PENDING" and not j.suspended) or (
            (j.completing or j.suspended) and j.job_id in self._pending))  # ended or not: told at a later listing
        new_ending = (set(ending_jobs) & runs.running) - self._ending - self._given_back
        for job_id in sorted(new_ending):
            log.warning("burst job %d is ending (Slurm's drain signal reached its workers: a preemption, its time "
                        "limit or a requeue): nothing new goes there; lost unless Slurm requeues it", job_id)
        drained = (set(out_of_use_jobs) & listed_ids) - self._ending - self._given_back
        for job_id in sorted(drained):
            log.warning("burst job %d: none of its GPUs can take a worker (its nodes out of use in Slurm, or "
                        "every GPU cordoned); giving it back", job_id)
        self._signalled = (self._signalled | new_ending) & listed_ids
        self._ending = (self._ending | new_ending | drained) & listed_ids
        marked = {j.job_id for j in self.listed if is_released_comment(j.comment)}
        for job_id in sorted(self._ending - marked):
            self._mark(job_id, True, "ending ")
        releasing = self.releasing | self._ending
        self._given_back |= releasing
        self._given_back &= listed_ids  # gone from Slurm's listing: nothing more to tell about it
        self._counted_cancelled &= listed_ids
        self._account(current, Counter(workers_by_job) + Counter(draining_by_job), now_s)  # a draining worker works on
        self._completing_since_s = {j.job_id: self._completing_since_s.get(j.job_id, now_s)
                                    for j in current if j.completing}
        self._suspended_since_s = {j.job_id: min(now_s, self._suspended_since_s.get(j.job_id, now_s))
                                   for j in current if j.suspended}  # a time ahead of the clock: taken as now
        judged = as_judged(current, frozenset(self._given_back - self._signalled), self._completing_since_s, now_s)
        decision = decide_burst(self.policy, target_workers=target_workers, allocation_slots=allocation_slots,
                                jobs=judged, releasing=releasing, last_submit_s=self.last_submit_s, now_s=now_s,
                                released_for_good=frozenset(self._ending),
                                suspended_too_long=frozenset(j for j, since_s in self._suspended_since_s.items()
                                                             if now_s - since_s >= self.suspended_limit_s))
        self.last_decision = decision
        for job_id in decision.cancel:
            self._given_back.add(job_id)
            done = self._try(f"cancel burst job {job_id}", lambda j=job_id: self.jobs.cancel(j))
            # once per job, when Slurm took it; one Slurm's drain signal ends is counted lost when it does
            if done and job_id not in self._signalled and job_id not in self._counted_cancelled:
                self._counted_cancelled.add(job_id)
                self.counters.cancelled += 1
        for job_id in decision.release:
            self._mark(job_id, True)
            self._given_back.add(job_id)
        for job_id in decision.keep:
            self._mark(job_id, False)
            self._given_back.discard(job_id)  # taken back: lost again if it ends unreleased
        for _ in range(decision.submit):
            try:
                self._comments[self.jobs.submit(exclude_nodes)] = burst_job_comment(self.jobs.parent_job_id)
                self.counters.submitted += 1
            except SlurmError as exc:
                self._error(f"submit a burst job failed: {exc}")
            self.last_submit_s = now_s  # a refused submission waits the cooldown too
        if decision.submit or decision.cancel or decision.release or decision.keep:
            log.info("%s", decision.reason)
        return decision

    def _requeued(self, job_id: int) -> None:
        """A running job Slurm put back in the queue: its workers are gone (lost steps), the job waits
        as capacity asked for, and runs again as a new burst job. A drain signal its workers took for
        the end of the job (the requeue's SIGTERM) no longer holds: the ending mark is taken back."""
        self.counters.requeued += 1
        log.warning("burst job %d was requeued by Slurm: its workers are gone; it waits in the queue again as a "
                    "pending burst job (no replacement is submitted for it)", job_id)
        if job_id in self._ending:
            self._ending.discard(job_id)
            self._signalled.discard(job_id)
            self._given_back.discard(job_id)
            self._mark(job_id, False, "requeued ")
            wanted = self._comments.get(job_id)
            if wanted is not None:
                self.listed = [replace(j, comment=wanted) if j.job_id == job_id else j for j in self.listed]

    # ---- memory --------------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        """What a restarted controller needs to go on counting and deciding as this one would."""
        c = self.counters
        return {"submitted": c.submitted, "cancelled": c.cancelled, "lost": c.lost, "requeued": c.requeued,
                "gpu_s_held": c.gpu_s_held, "gpu_s_used": c.gpu_s_used, "given_back": sorted(self._given_back),
                "ending": sorted(self._ending), "signalled": sorted(self._signalled), "running": sorted(self._ran),
                "pending": sorted(self._pending),
                "last_submit_s": self.last_submit_s,
                "suspended_since": sorted([job_id, since_s] for job_id, since_s in self._suspended_since_s.items())}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back what :meth:`to_state` saved (validated by the caller): the counters go on from
        where they were, a job given back before the restart is not counted lost when it ends, and
        one that ended while no controller ran is, the submission cooldown runs from the last
        submission, and a suspended job's time to be given back from when it was first seen so."""
        self.counters = replace(self.counters, submitted=state["submitted"], cancelled=state["cancelled"],
                                lost=state["lost"], requeued=state["requeued"], gpu_s_held=state["gpu_s_held"],
                                gpu_s_used=state["gpu_s_used"])
        self._given_back = set(state["given_back"])
        self._ending = set(state["ending"])
        self._signalled = set(state["signalled"]) & self._ending
        self._ran = frozenset(state["running"])
        self._pending = frozenset(state.get("pending", ()))
        self.last_submit_s = state["last_submit_s"]
        self._suspended_since_s = {int(job_id): float(since_s) for job_id, since_s in state.get("suspended_since", ())}

    # ---- report --------------------------------------------------------------------------------
    def status_rows(self, workers_by_job: Mapping[int, int]) -> list[dict[str, Any]]:
        """One row per burst job: id, state, nodes, GPUs, workers, pending reason, (expected) start."""
        releasing = self.releasing
        return [{"job_id": j.job_id, "state": "RELEASING" if j.job_id in releasing and j.state == "RUNNING" else j.state,
                 "nodes": list(j.nodes), "gpus": j.gpus_per_node * max(1, j.node_count),
                 "workers": workers_by_job.get(j.job_id, 0), "pending_reason": j.reason, "start_time": j.start_time}
                for j in self.listed]

    def _account(self, current: tuple[BurstJob, ...], workers_by_job: Mapping[int, int], now_s: float) -> None:
        if self._last_seen_s is not None and now_s > self._last_seen_s:
            dt_s = now_s - self._last_seen_s
            by_id = {j.job_id: j for j in self.listed}
            for job in current:
                if job.phase == "RUNNING":
                    listed = by_id[job.job_id]
                    self.counters.gpu_s_held += dt_s * listed.gpus_per_node * max(1, listed.node_count)
                    self.counters.gpu_s_used += dt_s * self.gpus_per_worker * workers_by_job.get(job.job_id, 0)
        self._last_seen_s = now_s

    def _mark(self, job_id: int, released: bool, kind: str = "") -> None:
        """Mark a job released (being emptied) or kept in its comment, and remember the comment. A
        job Slurm says has finished (still listed while it completes) needs no mark: no error."""
        try:
            self.jobs.mark_released(job_id, released)
        except SlurmError as exc:
            if JOB_FINISHED not in str(exc):
                self._error(f"{'release' if released else 'keep'} {kind}burst job {job_id} failed: {exc}")
                return
            log.debug("burst job %s has finished: no mark needed", job_id)
        self._comments[job_id] = burst_job_comment(self.jobs.parent_job_id, released)

    def _try(self, what: str, action: Any) -> bool:
        try:
            action()
            return True
        except SlurmError as exc:
            self._error(f"{what} failed: {exc}")
            return False

    def _error(self, message: str) -> None:
        log.warning("%s", message)
        self.counters.errors = [*self.counters.errors[-9:], message]
