"""Fixtures for tests that run the real controller in a real allocation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.devcluster.cluster import DevCluster
from tests.cluster.controller_harness import (
    ControllerJob,
    start_controller_job,
    stop_controller_job,
)


@pytest.fixture
def job(devcluster: DevCluster, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ControllerJob]:
    """A 2-node job running the controller (options via indirect parametrize)."""
    options: dict[str, Any] = getattr(request, "param", {})
    started = start_controller_job(devcluster, tmp_path, **options)
    yield started
    stop_controller_job(started)
