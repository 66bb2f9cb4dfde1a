"""The bad-input probes that need a Slurm cluster of their own (tests/cluster/bad_input.py
``scratch_cluster_probes``): bad configurations of a controller for a job there, and that
cluster's slurmctld hung and killed under the running controller. They share nothing with the
dev cluster, so they run in the second pytest, beside the tests that take it one after another."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.cluster.bad_input import markdown, scratch_cluster_probes

pytestmark = pytest.mark.cluster


def test_bad_config_and_a_failing_slurmctld_get_a_clear_error_and_lose_nothing() -> None:
    # a short directory: slurmstepd's sockets live in the spool under it (at most 107 bytes a path)
    tmp = Path(tempfile.mkdtemp(prefix="se-scratch-"))
    try:
        probes = list(scratch_cluster_probes(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n" + markdown(probes, tmp))
    failed = [p for p in probes if not p.ok]
    assert not failed, "\n".join(f"{p.area}: {p.tried}: got {p.got}; {p.kept}" for p in failed)
    assert len(probes) >= 15
