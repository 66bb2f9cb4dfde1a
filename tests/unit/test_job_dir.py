"""The job's state directory is keyed by cluster and job id and records the job it belongs to;
a directory of another job (an earlier job with the same id, one without a record) is moved
aside and the job starts clean, with a note. On real directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_elastic.client.files import job_state_dir
from slurm_elastic.client.locate import locate
from slurm_elastic.controller.job_dir import JOB_FILE, claim_state_dir, read_identity
from slurm_elastic.core.job_identity import JobIdentity, identity_mismatch
from slurm_elastic.slurm.parse import parse_jobs_json

JOB = JobIdentity("dev", 17, 1_700_000_000, 0, "alice")
DATA = Path(__file__).parent / "data"


def old_job_dir(tmp: Path, identity: JobIdentity | None) -> Path:
    """A directory an earlier job left: state, token, queue, and its job record (if any)."""
    state_dir = tmp / "jobs" / "dev" / "17"
    state_dir.mkdir(parents=True)
    (state_dir / "state.json").write_text('{"old": true}')
    (state_dir / "token").write_text("old-token\n")
    (state_dir / "rollouts.sqlite").write_bytes(b"old groups")
    if identity is not None:
        (state_dir / JOB_FILE).write_text(json.dumps({"format": "slurm-elastic-job", **identity.to_json()}))
    return state_dir


def test_a_new_directory_records_its_job(tmp_path: Path) -> None:
    claimed = claim_state_dir(tmp_path / "jobs" / "dev" / "17", JOB)
    assert claimed.note == "" and read_identity(claimed.path) == JOB


def test_the_same_job_keeps_its_directory(tmp_path: Path) -> None:
    state_dir = old_job_dir(tmp_path, JOB)  # a restarted controller of the same job
    claimed = claim_state_dir(state_dir, JOB)
    assert claimed.note == "" and (state_dir / "token").read_text() == "old-token\n"
    assert not claimed.requeued


def test_a_requeued_job_keeps_its_directory(tmp_path: Path) -> None:
    state_dir = old_job_dir(tmp_path, JOB)
    requeued = JobIdentity("dev", 17, JOB.submit_time_s + 600, 1, "alice")  # Slurm gives a new submit time
    claimed = claim_state_dir(state_dir, requeued)
    assert claimed.note == "" and claimed.requeued
    assert (state_dir / "rollouts.sqlite").exists() and read_identity(state_dir) == requeued


@pytest.mark.parametrize(("recorded", "why"), [
    (JobIdentity("dev", 17, 1_600_000_000, 0, "alice"), "submitted at 1600000000, not 1700000000"),
    (JobIdentity("dev", 17, 1_600_000_000, 3, "alice"), "submitted at 1600000000"),  # more restarts: not a requeue
    (JobIdentity("other", 17, 1_700_000_000, 0, "alice"), "cluster 'other', not 'dev'"),
    (None, "no readable job record"),
])
def test_another_jobs_directory_is_moved_aside_and_the_job_starts_clean(
        tmp_path: Path, recorded: JobIdentity | None, why: str) -> None:
    state_dir = old_job_dir(tmp_path, recorded)
    claimed = claim_state_dir(state_dir, JOB)
    assert why in claimed.note and "this job starts clean" in claimed.note
    aside = list(state_dir.parent.glob("17.stale-*"))
    assert len(aside) == 1 and aside[0].name in claimed.note
    assert (aside[0] / "rollouts.sqlite").read_bytes() == b"old groups"  # nothing of the old job is lost
    assert sorted(p.name for p in state_dir.iterdir()) == [JOB_FILE] and read_identity(state_dir) == JOB


def test_a_damaged_job_record_counts_as_none(tmp_path: Path) -> None:
    state_dir = old_job_dir(tmp_path, None)
    (state_dir / JOB_FILE).write_text('{"format": "slurm-elastic-job", "cluster": "dev", "job_id": "17"}')
    assert "no readable job record" in claim_state_dir(state_dir, JOB).note


def test_identity_rule() -> None:
    assert identity_mismatch(JOB, JOB) == ""
    assert identity_mismatch(JOB, JobIdentity("dev", 17, 0)) == ""  # Slurm did not say: the id decides
    assert "job 17, not 18" in identity_mismatch(JOB, JobIdentity("dev", 18, JOB.submit_time_s))
    later_other_user = JobIdentity("dev", 17, JOB.submit_time_s + 5, 1, "bob")
    assert identity_mismatch(JOB, later_other_user)


def test_the_directory_is_keyed_by_cluster_and_job_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_ELASTIC_HOME", str(tmp_path))
    assert job_state_dir("dev", 17) == tmp_path / "jobs" / "dev" / "17"
    assert job_state_dir("../etc", 17) == tmp_path / "jobs" / "_etc" / "17"
    assert job_state_dir("dev", 17, "/scratch/{cluster}-{job_id}") == Path("/scratch/dev-17")


def test_squeue_json_gives_the_identity() -> None:
    job = parse_jobs_json((DATA / "squeue_job_22.05.json").read_text())[0]
    assert (job.cluster, job.submit_time_s, job.restart_count) == ("dev", 1795356659, 0)


def test_status_finds_the_directory_of_this_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_ELASTIC_HOME", str(tmp_path))
    for cluster in ("dev", "other"):  # two clusters sharing a home directory, both with a job 17
        state_dir = tmp_path / "jobs" / cluster / "17"
        state_dir.mkdir(parents=True)
        (state_dir / "controller.json").write_text(json.dumps({"url": f"http://{cluster}:1"}))
        (state_dir / "token").write_text("t\n")
    conf = tmp_path / "slurm.conf"
    conf.write_text("# a cluster\nClusterName=other\nSlurmctldHost=x\n")
    monkeypatch.delenv("SLURM_CLUSTER_NAME", raising=False)
    monkeypatch.setenv("SLURM_CONF", str(conf))
    assert locate(17).url == "http://other:1"  # from slurm.conf: no call to Slurm
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "dev")  # inside a job step
    assert locate(17).url == "http://dev:1"


OTHER_FIELD = [json.dumps({"format": "slurm-elastic-job", **{**JOB.to_json(), **change}})
               for change in ({"job_id": 9999}, {"cluster": "elsewhere"}, {"submit_time_s": 1_700_000_001})]


@pytest.mark.parametrize("record", [None, "", "{trunc", '{"format": "slurm-elastic-job", "cluster": 5}', *OTHER_FIELD])
def test_a_lost_record_of_a_directory_the_job_names_is_written_again(tmp_path: Path, record: str | None) -> None:
    """The job's own Slurm comment names the directory (only its controllers set it): a missing,
    damaged or changed ``job.json`` there is this job's, and the directory with its queue and
    token is kept. Before, one changed field (job id 9999, in a live audit) moved the directory
    aside: a new token, the queue and versions gone, the trainer refused with 403."""
    state_dir = old_job_dir(tmp_path, JOB)
    if record is None:
        (state_dir / JOB_FILE).unlink()
    else:
        (state_dir / JOB_FILE).write_text(record)
    claimed = claim_state_dir(state_dir, JOB, named_by_job=True)
    assert "kept, and the record written again" in claimed.note and claimed.path == state_dir
    assert (state_dir / "rollouts.sqlite").read_bytes() == b"old groups" and read_identity(state_dir) == JOB
    assert not list(state_dir.parent.glob("17.stale-*"))
    assert claim_state_dir(state_dir, JOB, named_by_job=True).note == ""  # the record is whole again


def test_no_controller_found_says_why_slurm_could_not_tell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slurm_elastic.client import locate as locating
    from slurm_elastic.errors import ControllerUnreachableError

    monkeypatch.setenv("SLURM_ELASTIC_HOME", str(tmp_path))
    monkeypatch.setattr(locating, "local_cluster_name", lambda: "")
    view = locating.SlurmView(None, "Slurm did not answer: squeue: fatal: Could not establish a configuration source")
    with pytest.raises(ControllerUnreachableError) as raised:
        locating.locate(3893, view=view)
    assert (f"looked in {tmp_path}/jobs/*/3893 (no cluster name here: SLURM_CLUSTER_NAME is unset and "
            in str(raised.value)), str(raised.value)
    assert "Slurm did not answer: squeue: fatal" in str(raised.value) and "is SLURM_CONF set" in str(raised.value)


def a_controller_dir(root: Path, cluster: str, job_id: int) -> Path:
    state_dir = root / "jobs" / cluster / str(job_id)
    state_dir.mkdir(parents=True)
    (state_dir / "controller.json").write_text(json.dumps({"url": f"http://{cluster}:1"}))
    (state_dir / "token").write_text("t\n")
    return state_dir


def test_with_no_cluster_name_the_one_cluster_that_has_the_job_is_taken(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """SLURM_CONF unset, Slurm unreachable: before, `status 1250` said "looked in no place" though
    ~/.slurm-elastic/jobs/dev/1250 was there."""
    from slurm_elastic.client import locate as locating

    monkeypatch.setenv("SLURM_ELASTIC_HOME", str(tmp_path))
    monkeypatch.delenv("SLURM_CLUSTER_NAME", raising=False)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-slurm.conf"))
    unreachable = locating.SlurmView(None, "Slurm did not answer: squeue: fatal: Could not establish a configuration")
    a_controller_dir(tmp_path, "dev", 1250)
    (tmp_path / "jobs" / "other").mkdir()  # a cluster without that job
    assert locating.locate(1250, view=unreachable).url == "http://dev:1"
    a_controller_dir(tmp_path, "other", 1250)
    with pytest.raises(locating.ControllerUnreachableError) as raised:
        locating.locate(1250, view=unreachable)
    assert (f"clusters dev, other each have a job 1250 ({tmp_path}/jobs/dev/1250, {tmp_path}/jobs/other/1250): set "
            "SLURM_CLUSTER_NAME to the job's cluster") in str(raised.value), str(raised.value)
    assert f"looked in {tmp_path}/jobs/*/1250 (no cluster name here" in str(raised.value)
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "other")
    assert locating.locate(1250, view=unreachable).url == "http://other:1"


def test_no_controller_found_for_a_job_that_is_not_ours_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slurm_elastic.client import locate as locating
    from slurm_elastic.errors import ControllerUnreachableError
    from slurm_elastic.slurm.parse import JobInfo

    monkeypatch.setenv("SLURM_ELASTIC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(locating, "local_cluster_name", lambda: "dev")
    sleeper = JobInfo(4539, "wrap", "RUNNING", ("node1",), "node1", "", "u", "debug")  # `sbatch --wrap "sleep 120"`
    with pytest.raises(ControllerUnreachableError) as raised:
        locating.locate(4539, view=locating.SlurmView(sleeper, ""))
    assert ("Slurm's job 4539 (RUNNING) carries no slurm-elastic comment: not a slurm-elastic job, or one whose "
            "controller has not started yet") in str(raised.value)


def test_a_configured_state_dir_is_found_while_slurm_does_not_answer(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``controller.state_dir`` set, the CLI found the directory only through the job's Slurm
    comment: while slurmctld hung, status said "no controller found" (exit 3) though the controller
    answered. Its controller names it in the default place too."""
    from slurm_elastic.client import locate as locating
    from slurm_elastic.controller.main import point_to_state_dir

    monkeypatch.setenv("SLURM_ELASTIC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "dev")
    scratch = tmp_path / "scratch" / "17"
    scratch.mkdir(parents=True)
    (scratch / "controller.json").write_text(json.dumps({"url": "http://batch-host:1"}))
    (scratch / "token").write_text("t\n")
    hung = locating.SlurmView(None, "Slurm did not answer: squeue: Socket timed out")
    with pytest.raises(locating.ControllerUnreachableError):
        locating.locate(17, view=hung)
    point_to_state_dir(job_state_dir("dev", 17), scratch)
    assert locating.locate(17, view=hung).url == "http://batch-host:1"
