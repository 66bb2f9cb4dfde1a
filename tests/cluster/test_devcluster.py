"""The dev cluster's own life cycle, on a second small cluster with its own ports and directory."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec, port_is_free
from slurm_elastic.errors import DevClusterError

pytestmark = pytest.mark.cluster


@pytest.fixture
def small_cluster(tmp_path: Path, devcluster: DevCluster) -> Iterator[DevCluster]:
    spec = DevClusterSpec(dir=tmp_path / "dc", nodes=1, gpus_per_node=2, ctld_port=17817,
                          node_base_port=17901, cluster_name="tiny", node_prefix="tiny", first_job_id=5_000_000)
    cluster = DevCluster(spec)
    yield cluster
    cluster.down()


def test_up_is_idempotent_and_down_leaves_nothing(small_cluster: DevCluster) -> None:
    small_cluster.up()
    pids = {d: small_cluster.daemon_pid(d) for d in ("slurmctld", "slurmd-tiny1")}
    assert all(pids.values())
    assert small_cluster.node_states() == {"tiny1": "idle"}
    small_cluster.up()  # second call: finds it up, starts nothing
    assert {d: small_cluster.daemon_pid(d) for d in pids} == pids
    stopped = small_cluster.down()
    assert set(pids.values()) <= set(stopped)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in stopped)
    assert port_is_free(17817) and port_is_free(17901)


def test_port_in_use_is_a_clear_error(small_cluster: DevCluster) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 17901))
        sock.listen()
        with pytest.raises(DevClusterError, match=r"port 17901 .*slurmd-tiny1.* in use"):
            small_cluster.up()


def test_fake_gpus_are_distinct_live_char_devices(devcluster: DevCluster) -> None:
    for node in devcluster.spec.node_names():
        devices = sorted((devcluster.dir / "dev" / node).glob("gpu*"))
        assert len(devices) == devcluster.spec.gpus_per_node
        rdevs = {d.stat().st_rdev for d in devices}
        assert len(rdevs) == len(devices)  # distinct (major, minor) within the node
        null, urandom = Path("/dev/null").stat().st_rdev, Path("/dev/urandom").stat().st_rdev
        assert null not in rdevs and urandom not in rdevs  # never a device every program needs


def test_cli_env_and_status(devcluster: DevCluster) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["devcluster", "env", "--dir", str(devcluster.dir)])
    assert result.exit_code == 0 and result.output == f"export SLURM_CONF={devcluster.conf_path}\n"
    result = runner.invoke(main, ["devcluster", "status", "--dir", str(devcluster.dir)])
    assert result.exit_code == 0 and "node1" in result.output and "idle" in result.output


def test_cli_reports_missing_cluster_without_traceback(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["devcluster", "status", "--dir", str(tmp_path / "none")])
    assert result.exit_code == 1
    assert "no dev cluster in" in result.output and "Traceback" not in result.output


def test_cli_up_with_real_gpus_on_a_host_without_any_is_a_clear_error_and_starts_nothing(
        tmp_path: Path, devcluster: DevCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """`devcluster up --real-gpus` as a user types it, on a host without NVIDIA device files (as
    this one, and the reading is pinned so that a GPU host runs the same test)."""
    monkeypatch.setattr("slurm_elastic.devcluster.cluster.nvidia_gpu_devices", lambda: [])
    result = CliRunner().invoke(main, ["devcluster", "up", "--real-gpus", "--nodes", "1", "--dir", str(tmp_path / "dc"),
                                       "--ctld-port", "17817", "--node-base-port", "17901", "--node-prefix", "rg"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "--real-gpus: this host has no NVIDIA GPU device files (/dev/nvidia0, ...)" in result.output
    assert not list((tmp_path / "dc" / "run").glob("*.pid")) and port_is_free(17817)
