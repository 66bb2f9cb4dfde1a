"""A burst job whose Slurm comment or name someone overwrote: the manager sets it back (the epilog,
`stop` and a restarted controller find burst jobs by both); a look-alike is left alone."""

from __future__ import annotations

from pathlib import Path

from slurm_elastic.controller.burst_jobs import BurstJobs, burst_policy
from slurm_elastic.controller.burst_manager import BurstManager
from slurm_elastic.controller.config import parse_config
from slurm_elastic.core.burst import burst_job_comment, burst_job_name
from slurm_elastic.errors import SlurmCommandError
from slurm_elastic.slurm.parse import QueuedJob

PARENT = 4242
CONFIG = parse_config({"burst": {"max_jobs": 2, "gpus_per_job": 2, "submit_cooldown_s": 0}})


class FakeSlurm:
    """Jobs by id -> (name, comment); sbatch gives a burst job its parent's comment and records its
    script as the job's command."""

    def __init__(self) -> None:
        self.jobs: dict[int, tuple[str, str]] = {}
        self.commands: dict[int, str] = {}
        self.refusal: str | None = None
        self.comment_calls = 0
        self.id_listings = 0
        self.user_listings = 0

    def submit_batch(self, script: Path) -> int:
        job_id = 100 + len(self.jobs)
        self.jobs[job_id] = (burst_job_name(PARENT), burst_job_comment(PARENT))
        self.commands[job_id] = str(script)
        return job_id

    def _listed(self, job_id: int) -> QueuedJob:
        name, comment = self.jobs[job_id]
        return QueuedJob(job_id, "RUNNING", ("node1",), 2, "", "", 1, "p", name, comment, self.commands.get(job_id, ""))

    def list_jobs_named(self, name: str, user: str | None = None) -> list[QueuedJob]:
        return [self._listed(job_id) for job_id, (n, _) in self.jobs.items() if n == name]

    def list_my_jobs(self) -> list[QueuedJob]:
        self.user_listings += 1
        return [self._listed(job_id) for job_id in self.jobs]

    def set_job_comment(self, job_id: int, comment: str) -> None:
        self.comment_calls += 1
        if self.refusal:
            raise SlurmCommandError(["scontrol", "update"], 1, "", self.refusal)
        self.jobs[job_id] = (self.jobs[job_id][0], comment)

    def overwrite(self, job_id: int, comment: str) -> None:
        self.jobs[job_id] = (self.jobs[job_id][0], comment)

    def list_jobs(self, job_ids: list[int]) -> list[QueuedJob]:
        self.id_listings += 1
        return [self._listed(job_id) for job_id in self.jobs if job_id in job_ids]

    def set_job_name(self, job_id: int, name: str) -> None:
        if self.refusal:
            raise SlurmCommandError(["scontrol", "update"], 1, "", self.refusal)
        self.jobs[job_id] = (name, self.jobs[job_id][1])


def manager(slurm: FakeSlurm, tmp_path: Path) -> BurstManager:
    made = BurstManager(BurstJobs(slurm, CONFIG, PARENT, tmp_path), burst_policy(CONFIG), 1)  # type: ignore[arg-type]
    made.observe()
    return made


def step(made: BurstManager, target: int, workers: dict[int, int]) -> None:
    made.step(target_workers=target, allocation_slots=4, workers_by_job=workers, draining_by_job={}, now_s=0)


def test_an_overwritten_comment_is_set_back_with_its_released_mark(tmp_path: Path) -> None:
    slurm = FakeSlurm()
    made = manager(slurm, tmp_path)
    step(made, 8, {})
    made.observe()
    a, b = sorted(slurm.jobs)
    step(made, 6, {a: 2, b: 1})  # b is emptied: its comment says so
    made.observe()
    assert made.releasing == {b}
    slurm.overwrite(a, "my own note")
    slurm.overwrite(b, "")
    made.observe()
    assert [j.job_id for j in made.listed] == [a, b] and made.releasing == {b}
    assert slurm.jobs[a][1] == burst_job_comment(PARENT) and slurm.jobs[b][1] == burst_job_comment(PARENT, True)
    assert manager(slurm, tmp_path).releasing == {b}  # a restarted controller reads it from Slurm again


def test_a_look_alike_is_neither_listed_nor_touched(tmp_path: Path) -> None:
    slurm = FakeSlurm()
    slurm.jobs[7] = (burst_job_name(PARENT), "someone else's")
    made = manager(slurm, tmp_path)
    assert made.listed == [] and slurm.comment_calls == 0 and slurm.jobs[7][1] == "someone else's"


def test_a_refused_set_back_is_reported_once_and_the_job_kept(tmp_path: Path) -> None:
    slurm = FakeSlurm()
    made = manager(slurm, tmp_path)
    step(made, 6, {})
    made.observe()
    (job_id,) = slurm.jobs
    slurm.overwrite(job_id, "my own note")
    slurm.refusal = "Access/permission denied"
    for _ in range(3):
        made.observe()
    assert [j.job_id for j in made.listed] == [job_id] and slurm.comment_calls == 3
    assert [e for e in made.counters.errors if "comment back" in e] == [
        f"setting burst job {job_id}'s comment back to {burst_job_comment(PARENT)!r} failed: "
        f"{SlurmCommandError(['scontrol', 'update'], 1, '', 'Access/permission denied')}"]


def test_a_job_that_finished_before_its_release_mark_is_no_error(tmp_path: Path) -> None:
    """Seen on the dev cluster after an operator's `scancel` of a burst job: while Slurm still listed
    it (completing), each tick's release mark failed with "Job has already finished", a warning
    and a status error each time."""
    slurm = FakeSlurm()
    made = manager(slurm, tmp_path)
    step(made, 8, {})
    made.observe()
    a, b = sorted(slurm.jobs)
    slurm.refusal = f"Job has already finished for job {b}"
    for _ in range(3):
        step(made, 6, {a: 2, b: 1})  # b is being emptied: its release is marked
        made.observe()
    assert slurm.comment_calls >= 1 and made.counters.errors == []


def test_a_renamed_job_is_still_listed_and_its_name_set_back(tmp_path: Path) -> None:
    slurm = FakeSlurm()
    made = manager(slurm, tmp_path)
    step(made, 8, {})
    made.observe()
    a, b = sorted(slurm.jobs)
    assert slurm.id_listings == 0  # nothing missing: no second call
    slurm.jobs[a] = ("my renamed job", slurm.jobs[a][1])
    made.observe()
    assert [j.job_id for j in made.listed] == [a, b] and slurm.jobs[a][0] == burst_job_name(PARENT)
    assert slurm.id_listings == 1
    slurm.jobs[b] = ("other name", slurm.jobs[b][1])
    slurm.refusal = "Access/permission denied"
    for _ in range(3):
        made.observe()
    assert [j.job_id for j in made.listed] == [a, b]  # still counted, used and given back
    assert len([e for e in made.counters.errors if "name back" in e]) == 1
    del slurm.jobs[b]  # it ended: no longer listed, and no longer looked for
    made.observe()
    calls = slurm.id_listings
    made.observe()
    assert [j.job_id for j in made.listed] == [a] and slurm.id_listings == calls


def test_a_renamed_look_alike_is_not_looked_for(tmp_path: Path) -> None:
    slurm = FakeSlurm()
    slurm.jobs[7] = ("someone else's", burst_job_comment(PARENT))
    made = manager(slurm, tmp_path)
    assert made.listed == [] and slurm.id_listings == 0


def test_a_controller_started_after_a_rename_and_an_overwrite_finds_its_jobs_by_their_script(tmp_path: Path) -> None:
    """Slurm lets no one change a job's command: the burst script's path names the parent's jobs."""
    slurm = FakeSlurm()
    made = manager(slurm, tmp_path)
    step(made, 8, {})
    a, b = sorted(slurm.jobs)
    slurm.jobs[a] = ("my renamed job", "my own note")
    slurm.overwrite(b, "")
    slurm.jobs[7] = (burst_job_name(PARENT), "someone else's")  # a look-alike: another command
    restarted = manager(slurm, tmp_path)
    assert [j.job_id for j in restarted.listed] == [a, b] and slurm.user_listings == 2
    assert slurm.jobs[a] == slurm.jobs[b] == (burst_job_name(PARENT), burst_job_comment(PARENT))
    assert slurm.jobs[7] == (burst_job_name(PARENT), "someone else's")
    restarted.observe()
    assert slurm.user_listings == 2  # once per controller


def test_a_job_none_of_whose_gpus_can_take_a_worker_is_given_back_and_its_nodes_avoided(tmp_path: Path) -> None:
    """Every GPU of a running burst job cordoned (crashes, health, an operator): it held its GPUs
    with no worker and, counted against max_jobs, kept the pool from a usable one. It is given back,
    and the next is asked for elsewhere (--exclude)."""
    from slurm_elastic.controller.runtime import Controller
    from slurm_elastic.core.tick import TickResult
    from tests.stub_backend import ListedSteps

    config = parse_config({"agent": {"enabled": False}, "burst": {"max_jobs": 1, "gpus_per_job": 2}})
    ctl = Controller(config, PARENT, ListedSteps(), tmp_path / "state", gpus_by_node={"n1": (0,)})  # type: ignore[arg-type]
    for gpu in (0, 1):
        ctl.state.cordons.cordon_manual("bu2", gpu, "bad fan", 0.0)
    inputs = ctl.burst_inputs(TickResult(), {19: {"bu2": (0, 1)}}, 10.0)
    assert inputs["out_of_use_jobs"] == {19} and inputs["exclude_nodes"] == ("bu2",)
    assert ctl.burst_inputs(TickResult(), {}, 20.0)["exclude_nodes"] == ("bu2",)  # after it is gone too
    ctl.state.cordons.uncordon_manual("bu2", 0, 30.0)
    assert ctl.burst_inputs(TickResult(), {}, 30.0)["exclude_nodes"] == ()

    slurm = FakeSlurm()
    made = manager(slurm, tmp_path)
    made.step(target_workers=6, allocation_slots=4, workers_by_job={}, draining_by_job={}, now_s=0,
              exclude_nodes=("bu2",))
    assert "#SBATCH --exclude=bu2\n" in made.jobs.script.read_text()
