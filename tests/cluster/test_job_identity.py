"""A new job never adopts an earlier job's state directory that has the same job id (the bad-input
probe, on its own: tests/cluster/test_bad_input.py runs it with the others)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.devcluster.cluster import DevCluster
from tests.cluster.bad_input import identity_probe

pytestmark = pytest.mark.cluster


def test_an_earlier_jobs_directory_with_the_same_id_is_moved_aside(devcluster: DevCluster, tmp_path: Path) -> None:
    probe = identity_probe(devcluster, tmp_path)
    assert probe.ok, f"{probe.got}; {probe.kept}"
