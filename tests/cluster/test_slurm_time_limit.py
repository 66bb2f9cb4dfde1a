"""The largest time limit the config takes (``core.limits.MAX_TIME_LIMIT_MIN``) is the largest
Slurm keeps as given: sbatch takes a longer one without a word and Slurm wraps it. Held jobs only:
nothing runs, no node is taken."""

from __future__ import annotations

import re

import pytest

from slurm_elastic.core.limits import MAX_TIME_LIMIT_MIN
from slurm_elastic.devcluster.cluster import DevCluster
from slurm_elastic.slurm.runner import run_command

pytestmark = pytest.mark.cluster


def _held_job_time_limit(minutes: str) -> str:
    """``TimeLimit`` as ``scontrol show job`` reads it for a held job submitted with ``--time=minutes``."""
    result = run_command(["sbatch", "--parsable", "--hold", "--job-name=se-test-time-limit", f"--time={minutes}",
                          "--output=/dev/null", "--wrap", "true"])
    job_id = result.stdout.strip().split(";")[0]
    try:
        shown = run_command(["scontrol", "show", "job", job_id]).stdout
    finally:
        run_command(["scancel", job_id], check=False)
    match = re.search(r"TimeLimit=(\S+)", shown)
    assert match, shown
    return match.group(1)


def test_slurm_keeps_the_largest_time_limit_and_wraps_a_longer_one(devcluster: DevCluster) -> None:
    assert _held_job_time_limit(str(MAX_TIME_LIMIT_MIN)) == "24855-03:13:00"
    assert _held_job_time_limit(str(2**32 + 1)) == "00:01:00"  # taken, and wrapped to one minute
