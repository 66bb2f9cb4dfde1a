"""What the burst manager keeps across a controller restart (state.json's ``burst``): its counters
go on, a job given back before the restart is not counted lost when it ends after it, a job that
ended unreleased while no controller ran is, and the submission cooldown runs from the last
submission. A tick whose burst listing failed decides nothing about burst jobs."""

from __future__ import annotations

import json
from pathlib import Path

from slurm_elastic.controller.burst_jobs import BurstJobs, burst_policy
from slurm_elastic.controller.burst_manager import BurstManager
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.state_model import restore_state
from slurm_elastic.core.burst import burst_job_comment
from slurm_elastic.errors import SlurmCommandError
from slurm_elastic.slurm.parse import QueuedJob
from tests.stub_backend import ListedSteps
from tests.unit.test_burst_comment import PARENT, FakeSlurm

CONFIG = parse_config({"burst": {"max_jobs": 2, "gpus_per_job": 2, "submit_cooldown_s": 60}})


class FlakySlurm(FakeSlurm):
    """A FakeSlurm that cancels jobs, and whose job listing fails while ``down``."""

    down = False

    def cancel_job(self, job_id: int) -> None:
        self.jobs.pop(job_id, None)

    def list_jobs_named(self, name: str, user: str | None = None):  # type: ignore[no-untyped-def]
        if self.down:
            raise SlurmCommandError(["squeue"], 1, "", "slurm_load_jobs error: Socket timed out")
        return super().list_jobs_named(name, user)


def new_manager(slurm: FakeSlurm, tmp_path: Path) -> BurstManager:
    return BurstManager(BurstJobs(slurm, CONFIG, PARENT, tmp_path), burst_policy(CONFIG), 1)  # type: ignore[arg-type]


def step(made: BurstManager, target: int, workers: dict[int, int], now_s: float) -> None:
    made.observe()
    made.step(target_workers=target, allocation_slots=4, workers_by_job=workers, draining_by_job={}, now_s=now_s)


def restarted(made: BurstManager, slurm: FakeSlurm, tmp_path: Path) -> BurstManager:
    """A new manager given what ``made`` saved, through JSON and the state file's validation."""
    saved = json.loads(json.dumps({"burst": made.to_state()}))
    memory = restore_state(saved).burst
    assert memory is not None
    again = new_manager(slurm, tmp_path)
    again.restore(memory)
    return again


def test_counters_and_the_cooldown_go_on_after_a_restart(tmp_path: Path) -> None:
    slurm = FlakySlurm()
    made = new_manager(slurm, tmp_path)
    step(made, 6, {}, now_s=0)  # 2 slots missing: one burst job of 2 GPUs
    [job] = list(slurm.jobs)
    for t in (10, 20, 30):
        step(made, 6, {job: 2}, now_s=t)
    held, used = made.counters.gpu_s_held, made.counters.gpu_s_used
    assert made.counters.submitted == 1 and held == 60.0 and used == 60.0

    again = restarted(made, slurm, tmp_path)
    assert (again.counters.submitted, again.counters.gpu_s_held, again.counters.gpu_s_used) == (1, held, used)
    step(again, 8, {job: 2}, now_s=40)  # 2 more slots missing, but the last submission was 40 s ago
    assert len(slurm.jobs) == 1 and "cooldown" in again.last_decision.reason
    step(again, 8, {job: 2}, now_s=61)
    assert len(slurm.jobs) == 2 and again.counters.submitted == 2


def test_a_job_given_back_before_a_restart_is_not_lost_and_one_that_ended_unreleased_is(tmp_path: Path) -> None:
    slurm = FlakySlurm()
    made = new_manager(slurm, tmp_path)
    step(made, 8, {}, now_s=0)
    step(made, 8, {}, now_s=100)
    first, second = sorted(slurm.jobs)
    step(made, 6, {first: 2, second: 2}, now_s=110)
    step(made, 4, {first: 2}, now_s=120)  # no slot missing: the empty job is cancelled, the other released
    assert made.counters.cancelled >= 1 and made.counters.lost == 0
    given_back = set(made.to_state()["given_back"])
    assert given_back

    again = restarted(made, slurm, tmp_path)
    for job_id in list(slurm.jobs):  # both end while no controller runs: given back, not lost
        del slurm.jobs[job_id]
    step(again, 4, {}, now_s=130)
    assert again.counters.lost == 0

    step(again, 6, {}, now_s=300)
    [third] = [j for j in slurm.jobs]
    step(again, 6, {third: 2}, now_s=310)
    later = restarted(again, slurm, tmp_path)
    del slurm.jobs[third]  # preempted while no controller ran
    step(later, 6, {}, now_s=320)
    assert later.counters.lost == 1


def test_a_failed_listing_decides_nothing_and_a_first_failed_listing_submits_no_second_job(tmp_path: Path) -> None:
    slurm = FlakySlurm()
    made = new_manager(slurm, tmp_path)
    step(made, 6, {}, now_s=0)
    assert made.listed_now and len(slurm.jobs) == 1
    again = restarted(made, slurm, tmp_path)
    slurm.down = True
    assert not again.observe() and not again.listed_now  # the runtime skips the step then
    slurm.down = False
    assert again.observe() and again.listed_now


def test_a_bad_burst_memory_is_noted_and_the_counters_start_from_zero() -> None:
    restored = restore_state({"burst": {"submitted": -1}})
    assert restored.burst is None
    assert any("burst memory is not valid" in note for note in restored.notes)
    assert restore_state({}).burst is None and not restore_state({}).notes


def test_a_released_job_taken_back_is_lost_again_when_it_ends_unreleased(tmp_path: Path) -> None:
    slurm = FlakySlurm()
    made = new_manager(slurm, tmp_path)
    step(made, 6, {}, now_s=0)
    [job] = list(slurm.jobs)
    step(made, 4, {job: 2}, now_s=10)
    assert made.last_decision.release == (job,)
    step(made, 6, {job: 2}, now_s=20)
    assert made.last_decision.keep == (job,)
    again = restarted(made, slurm, tmp_path)
    del slurm.jobs[job]  # preempted
    step(again, 6, {}, now_s=30)
    assert again.counters.lost == 1


class BurstBackend(ListedSteps):
    """The stub backend with burst jobs: sbatch records a job, the job listing can fail."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted: list[int] = []
        self.listing_fails = False

    def submit_batch(self, script: Path) -> int:
        self.submitted.append(500 + len(self.submitted))
        return self.submitted[-1]

    def list_jobs_named(self, name: str, user: str | None = None) -> list[QueuedJob]:
        if self.listing_fails:
            raise SlurmCommandError(["squeue"], 1, "", "slurm_load_jobs error: Socket timed out")
        return [QueuedJob(j, "PENDING", (), 2, "Resources", "", 1, "p", name, burst_job_comment(1))
                for j in self.submitted]

    def list_my_jobs(self) -> list[QueuedJob]:
        return []


def test_the_controller_submits_nothing_on_a_failed_listing_and_keeps_its_counters_across_a_restart(
        tmp_path: Path) -> None:
    config = parse_config({"autoscaler": {"enabled": False},
                           "burst": {"max_jobs": 1, "gpus_per_job": 2, "submit_cooldown_s": 60}})
    backend = BurstBackend()
    controller = Controller(config, 1, backend, tmp_path, gpus_by_node={"node1": (0, 1)})  # type: ignore[arg-type]
    controller.scale(4)
    backend.listing_fails = True
    controller.tick()
    assert backend.submitted == []  # nothing known of the job's burst jobs: nothing decided
    backend.listing_fails = False
    controller.tick()
    assert len(backend.submitted) == 1
    restarted_controller = Controller(config, 1, backend, tmp_path,  # type: ignore[arg-type]
                                      gpus_by_node={"node1": (0, 1)})
    assert restarted_controller.status()["burst"]["submitted"] == 1
    restarted_controller.tick()
    assert len(backend.submitted) == 1


def test_a_worker_draining_in_a_burst_job_still_counts_as_using_its_gpu(tmp_path: Path) -> None:
    """It finishes its rollout there: before, gpu_s_used stopped the moment it began to drain
    while status's WORKERS column still counted it (a live audit)."""
    slurm = FlakySlurm()
    made = new_manager(slurm, tmp_path)
    step(made, 6, {}, now_s=0)
    [job] = list(slurm.jobs)
    step(made, 6, {job: 2}, now_s=10)
    used = made.counters.gpu_s_used
    made.observe()
    made.step(target_workers=6, allocation_slots=4, workers_by_job={job: 1}, draining_by_job={job: 1}, now_s=20)
    assert made.counters.gpu_s_used == used + 20.0


def test_a_cancel_is_counted_once_and_only_when_slurm_took_it(tmp_path: Path) -> None:
    class Refusing(FlakySlurm):
        refuse = True

        def cancel_job(self, job_id: int) -> None:
            if self.refuse:
                raise SlurmCommandError(["scancel"], 1, "", "scancel: error: Socket timed out")
            self.jobs.pop(job_id, None)

    slurm = Refusing()
    made = new_manager(slurm, tmp_path)
    step(made, 6, {}, now_s=0)
    [job] = list(slurm.jobs)
    step(made, 4, {}, now_s=10)  # not needed: cancelled, but Slurm refuses
    step(made, 4, {}, now_s=20)
    assert made.counters.cancelled == 0 and job in slurm.jobs
    slurm.refuse = False
    step(made, 4, {}, now_s=30)
    step(made, 4, {}, now_s=40)
    assert made.counters.cancelled == 1 and job not in slurm.jobs
