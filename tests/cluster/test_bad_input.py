"""Every bad input in tests/cluster/bad_input.py that needs the dev cluster gets a clear error and
loses nothing (the table in docs/bad-input.md comes from the same probes: bench/bench_bad_input.py;
those on a cluster of their own: tests/scratch_cluster/test_bad_input_scratch.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.devcluster.cluster import DevCluster
from tests.cluster.bad_input import markdown, shared_cluster_probes

pytestmark = pytest.mark.cluster


def test_bad_input_gets_a_clear_error_and_loses_nothing(devcluster: DevCluster, tmp_path: Path) -> None:
    probes = shared_cluster_probes(devcluster, tmp_path)
    print("\n" + markdown(probes, tmp_path))
    failed = [p for p in probes if not p.ok]
    assert not failed, "\n".join(f"{p.area}: {p.tried}: got {p.got}; {p.kept}" for p in failed)
    assert len(probes) >= 20
