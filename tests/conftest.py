"""Shared fixtures: the real dev cluster (brought up once per session, or reused) and allocations."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec, default_dir
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.runner import run_command


@pytest.fixture(scope="session")
def devcluster() -> DevCluster:
    """The local dev cluster: reused if up, else started (needs root and Debian's Slurm packages)."""
    directory = Path(os.environ.get("SLURM_ELASTIC_DEVCLUSTER_DIR", str(default_dir())))
    try:
        cluster = DevCluster.at(directory)
    except Exception:
        cluster = DevCluster(DevClusterSpec(dir=directory))
    cluster.up(wait_s=90)
    os.environ["SLURM_CONF"] = str(cluster.conf_path)
    return cluster


@pytest.fixture(scope="session")
def slurm(devcluster: DevCluster) -> SlurmCli:
    return SlurmCli()


def submit_allocation(nodes: int = 2, gpus_per_node: int = 4, name: str = "se-test-alloc",
                      extra: tuple[str, ...] = ()) -> int:
    """A running batch job that just holds its allocation (whole nodes, all GPUs, all memory)."""
    result = run_command([
        "sbatch", "--parsable", f"--nodes={nodes}", "--exclusive", f"--gres=gpu:{gpus_per_node}",
        "--mem=0", f"--job-name={name}", "--output=/dev/null", *extra, "--wrap", "sleep 100000",
    ])
    job_id = int(result.stdout.strip().split(";")[0])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = run_command(["squeue", "-h", "-j", str(job_id), "-o", "%T"], check=False).stdout.strip()
        if state == "RUNNING":
            return job_id
        time.sleep(0.2)
    run_command(["scancel", str(job_id)], check=False)
    raise RuntimeError(f"allocation {job_id} did not start within 60 s")


@pytest.fixture
def allocation(devcluster: DevCluster) -> Iterator[int]:
    """A fresh 2-node allocation holding every fake GPU; cancelled afterwards."""
    job_id = submit_allocation()
    yield job_id
    run_command(["scancel", str(job_id)], check=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not run_command(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip():
            break
        time.sleep(0.2)
