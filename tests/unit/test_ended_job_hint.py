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
