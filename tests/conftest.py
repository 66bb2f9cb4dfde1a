"""Shared fixtures: the real dev cluster (brought up once per session, or reused) and allocations."""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec, default_dir
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.runner import run_command


def _devcluster_dir() -> Path:
    return Path(os.environ.get("SLURM_ELASTIC_DEVCLUSTER_DIR", str(default_dir())))


@pytest.fixture(scope="session")
def devcluster(request: pytest.FixtureRequest) -> DevCluster:
    """The local dev cluster: reused if up, else started (needs root and Debian's Slurm packages)."""
    directory = _devcluster_dir()
    try:
        cluster = DevCluster.at(directory)
    except Exception:
        cluster = DevCluster(DevClusterSpec(dir=directory))
    cluster.up(wait_s=90)
    os.environ["SLURM_CONF"] = str(cluster.conf_path)
    _wait_for_other_jobs(cluster, float(os.environ.get("SLURM_ELASTIC_TEST_WAIT_FOR_JOBS_S", "900")),
                         say=lambda line: _say_now(request, line))
    return cluster


def _say_now(request: pytest.FixtureRequest, line: str) -> None:
    """Print past pytest's output capture: a wait of minutes must not look like a hang."""
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        print(line, flush=True)


def _wait_for_other_jobs(cluster: DevCluster, wait_s: float, say: Callable[[str], object]) -> None:
    """Jobs the tests did not start (an example still running on the same dev cluster, an earlier
    run's leftovers) hold nodes the tests need whole: wait up to ``wait_s`` for them to end, then
    cancel them, saying which, so that they fail no test."""
    def jobs() -> list[str]:
        result = run_command([cluster.binary("squeue"), "-h", "-a", "-o", "%i %j %T"], env=cluster.env(),
                             check=False, timeout_s=10)
        return [line.strip() for line in result.stdout.splitlines() if line.strip()]

    deadline = time.monotonic() + wait_s
    others = jobs()
    if others:
        say(f"\nthe dev cluster runs jobs the tests did not start; waiting up to {wait_s:g} s for them: {others}")
    while others and time.monotonic() < deadline:
        time.sleep(5)
        others = jobs()
    if others:
        warnings.warn(f"cancelled jobs the tests did not start, still running after {wait_s:g} s: {others}",
                      stacklevel=1)
        for line in others:
            run_command([cluster.binary("scancel"), line.split()[0]], env=cluster.env(), check=False)
        stop = time.monotonic() + 60
        while jobs() and time.monotonic() < stop:
            time.sleep(1)


@pytest.fixture(autouse=True)
def _dev_cluster_usable(request: pytest.FixtureRequest) -> None:
    """Before a test that uses the dev cluster: a daemon gone or a node down or drained (by an
    earlier test, or by the host) is brought back, with a warning naming it, so that one test's
    damage fails that test alone."""
    if "devcluster" not in request.fixturenames:
        return
    cluster: DevCluster = request.getfixturevalue("devcluster")
    if cluster.is_up():
        return
    before = cluster_report(cluster, log_lines=0)
    cluster.up(wait_s=90)
    warnings.warn(f"dev cluster not usable before {request.node.nodeid}, brought back:\n{before}", stacklevel=1)


def cluster_report(cluster: DevCluster, log_lines: int = 20) -> str:
    """Nodes with their states and reasons, the queue, and slurmctld's last ``log_lines``."""
    parts = []
    for title, argv in (("nodes", ["sinfo", "-h", "-N", "-p", cluster.spec.partition, "-o", "%N %T %E"]),
                        ("jobs", ["squeue", "-h", "-a", "-o", "%i %j %T %M %R"])):
        result = run_command([cluster.binary(argv[0]), *argv[1:]], env=cluster.env(), check=False, timeout_s=10)
        parts.append(f"{title}:\n{result.stdout.rstrip() or '(none)'}{result.stderr.rstrip()}")
    if log_lines:
        parts.append(cluster.log_tail("slurmctld", lines=log_lines))
    return "\n".join(parts)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, Any, None]:
    """A failed test that used the dev cluster reports the cluster's state with its failure."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and "devcluster" in getattr(item, "fixturenames", ()):
        try:
            cluster = DevCluster.at(_devcluster_dir())
            report.sections.append(("dev cluster when the test failed", cluster_report(cluster)))
        except Exception as exc:  # a report must never hide the failure it reports
            report.sections.append(("dev cluster when the test failed", f"(no report: {exc})"))


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
