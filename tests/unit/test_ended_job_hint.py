"""A job Slurm no longer knows: the CLI's error names the state directory it left, when that is here."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.client.locate import ask_slurm
from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.parse import JobInfo


class ForgetfulSlurm:
    def job_info(self, job_id: int) -> JobInfo:
        raise SlurmError(f"job {job_id} is unknown to Slurm (finished long ago, or never existed)")


def test_the_error_names_what_an_ended_job_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_ELASTIC_HOME", str(tmp_path))
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "dev")
    left = tmp_path / "jobs" / "dev" / "41"
    left.mkdir(parents=True)
    (left / "state.json").write_text("{}")
    with pytest.raises(SlurmError, match=f"unknown to Slurm .*; what it left is in {left} \\(state.json"):
        ask_slurm(41, ForgetfulSlurm())  # type: ignore[arg-type]
    with pytest.raises(SlurmError) as never:
        ask_slurm(42, ForgetfulSlurm())  # type: ignore[arg-type]
    assert "left" not in str(never.value)


def test_stop_of_an_ended_job_cancels_the_burst_jobs_it_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent timed out or was cancelled: nothing to stop, exit 0, and the burst jobs Slurm still
    lists for it (they would end by themselves soon) are cancelled now."""
    from click.testing import CliRunner

    from slurm_elastic.cli import main
    from slurm_elastic.client.locate import JobEndedError
    from slurm_elastic.commands import jobs

    def ended(job_id: int, *_args: object) -> dict[str, object]:
        raise JobEndedError(f"job {job_id} ended (TIMEOUT): its controller is gone; not sending the job's token")

    cancelled: list[int] = []
    monkeypatch.setattr(jobs, "call_controller", ended)
    monkeypatch.setattr(jobs.SlurmCli, "cancel_burst_jobs", lambda _self, job_id: cancelled.append(job_id) or [1043])
    result = CliRunner().invoke(main, ["stop", "1041"])
    assert result.exit_code == 0, result.output
    assert result.output == ("job 1041 ended (TIMEOUT): its controller is gone; not sending the job's token; nothing "
                             "to stop; burst jobs 1043 it left were cancelled\n")
    assert cancelled == [1041]


class _RefusingClient:
    """A controller that takes no connection (the restarting one `call_controller` waits for)."""

    def __enter__(self) -> _RefusingClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def scale(self, _workers: int) -> dict[str, object]:
        from slurm_elastic.errors import ControllerUnreachableError

        raise ControllerUnreachableError("connection refused", not_connected=True)


@pytest.mark.parametrize(("state", "gone"), [("COMPLETING", False), ("COMPLETED", False), ("", True)])
def test_a_refused_call_to_a_job_whose_batch_script_ended_fails_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: str, gone: bool) -> None:
    """A controller refusing connections while its job is COMPLETING (or has ended, or left Slurm's
    memory since) is not restarting: the batch script that would restart it has ended. The call
    says so at once instead of waiting RESTART_WAIT_S for it."""
    import time

    from slurm_elastic.client.locate import JobEndedError, JobHandle
    from slurm_elastic.commands import jobs

    def job_info(job_id: int) -> JobInfo:
        if gone:
            raise SlurmError(f"job {job_id} is unknown to Slurm (finished long ago, or never existed)")
        return JobInfo(job_id, "rl", state, ("node1",), "node1", "", "u", "debug")

    handle = JobHandle(41, tmp_path, "http://127.0.0.1:1", "t", {})
    monkeypatch.setattr(jobs, "_client", lambda job_id: (handle, _RefusingClient()))
    monkeypatch.setattr(jobs.SlurmCli, "job_info", lambda _self, job_id: job_info(job_id))
    started = time.monotonic()
    with pytest.raises(JobEndedError, match=r"job 41 (is COMPLETING: its batch script has ended|is COMPLETED|has ended)"):
        jobs.call_controller(41, "scale", 0)
    assert time.monotonic() - started < jobs.RESTART_WAIT_S / 2


def test_a_refused_call_while_the_job_runs_waits_for_the_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slurm_elastic.client.locate import JobHandle
    from slurm_elastic.commands import jobs
    from slurm_elastic.errors import ControllerUnreachableError

    handle = JobHandle(41, tmp_path, "http://127.0.0.1:1", "t", {})
    monkeypatch.setattr(jobs, "_client", lambda job_id: (handle, _RefusingClient()))
    monkeypatch.setattr(jobs.SlurmCli, "job_info",
                        lambda _self, job_id: JobInfo(job_id, "rl", "RUNNING", ("node1",), "node1", "", "u", "debug"))
    monkeypatch.setattr(jobs, "RESTART_WAIT_S", 0.6)
    monkeypatch.setattr(jobs, "RESTART_RETRY_S", 0.1)
    with pytest.raises(ControllerUnreachableError) as refused:
        jobs.call_controller(41, "scale", 0)
    assert refused.value.not_connected and "refused" in str(refused.value)


def test_stop_of_a_job_slurm_forgot_cancels_the_burst_jobs_it_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long over and purged from Slurm's memory: its burst jobs are still found by their name and
    comment and cancelled (exit 0); an id with none is the plain error it was (a typo, say)."""
    from click.testing import CliRunner

    from slurm_elastic.cli import main
    from slurm_elastic.commands import jobs

    def unknown(job_id: int, *_args: object) -> dict[str, object]:
        raise SlurmError(f"job {job_id} is unknown to Slurm (finished long ago, or never existed)")

    monkeypatch.setattr(jobs, "call_controller", unknown)
    monkeypatch.setattr(jobs.SlurmCli, "cancel_burst_jobs", lambda _self, job_id: [1043] if job_id == 1041 else [])
    left = CliRunner().invoke(main, ["stop", "1041"])
    assert left.exit_code == 0, left.output
    assert left.output == ("job 1041 is unknown to Slurm (finished long ago, or never existed); nothing to stop; "
                           "burst jobs 1043 it left were cancelled\n")
    typo = CliRunner().invoke(main, ["stop", "1042"])
    assert typo.exit_code == 1 and "job 1042 is unknown to Slurm" in typo.output
