"""The unit tests run as if outside any Slurm job, wherever pytest itself runs."""

from __future__ import annotations

import os

import pytest

SLURM_JOB_VARIABLES = ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_PROCID")


@pytest.fixture(autouse=True)
def outside_a_slurm_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest started inside an allocation (``srun pytest``, an sbatch script) would otherwise hand
    its job's and step's numbers to every worker SDK a test makes, whose heartbeats then name a
    step the test's controller never launched; a test that needs them sets them itself."""
    for name in SLURM_JOB_VARIABLES:
        if name in os.environ:
            monkeypatch.delenv(name)
