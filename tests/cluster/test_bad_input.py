"""Every bad input in tests/cluster/bad_input.py gets a clear error and loses nothing (the table in
docs/bad-input.md comes from the same probes: bench/bench_bad_input.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.devcluster.cluster import DevCluster
from tests.cluster.bad_input import markdown, run_all

pytestmark = pytest.mark.cluster


def test_bad_input_gets_a_clear_error_and_loses_nothing(devcluster: DevCluster, tmp_path: Path) -> None:
    probes = run_all(devcluster, tmp_path)
    print("\n" + markdown(probes, tmp_path))
    failed = [p for p in probes if not p.ok]
    assert not failed, "\n".join(f"{p.area}: {p.tried}: got {p.got}; {p.kept}" for p in failed)
    assert len(probes) >= 25
