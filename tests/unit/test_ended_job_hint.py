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
    monkeypatch.setattr(jobs, "_call", ended)
    monkeypatch.setattr(jobs.SlurmCli, "cancel_burst_jobs", lambda _self, job_id: cancelled.append(job_id) or [1043])
    result = CliRunner().invoke(main, ["stop", "1041"])
    assert result.exit_code == 0, result.output
    assert result.output == ("job 1041 ended (TIMEOUT): its controller is gone; not sending the job's token; nothing "
                             "to stop; burst jobs 1043 it left were cancelled\n")
    assert cancelled == [1041]
