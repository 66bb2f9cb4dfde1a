"""README's first command, as CI runs it: the elastic RL example end to end on the dev cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_elastic.devcluster.cluster import DevCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.second_cluster]
REPO = Path(__file__).resolve().parents[2]


def test_the_example_learns_scales_and_survives_a_controller_kill(devcluster: DevCluster) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run([sys.executable, "examples/run_example.py"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=600)
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "example: OK" in result.stdout
    assert "workers relaunched: 0" in result.stdout
    assert "workers placed on the cordoned GPU after the cordon: 0" in result.stdout
    # the controller's log, restart included: nothing it had to refuse or repair (a state file it
    # wrote and could not read back again, say)
    log = Path(re.search(r"log: (\S+)", result.stdout).group(1))  # type: ignore[union-attr]
    errors = [line for line in log.read_text().splitlines() if " ERROR " in line]
    assert errors == [], errors
