"""`devcluster up --real-gpus`: the first node's GPUs are the host's NVIDIA device files, in their
number's order; the other nodes keep fake GPUs; a host without any is a clear error."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from slurm_elastic.devcluster import cluster as cluster_module
from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec
from slurm_elastic.devcluster.devices import nvidia_gpu_devices
from slurm_elastic.devcluster.spec import render_config_files
from slurm_elastic.errors import DevClusterError


def _char_device(path: Path) -> None:
    """A character device with /dev/full's numbers (mknod needs root); a regular file where not root."""
    if os.geteuid() != 0:
        pytest.skip("creating character devices needs root")
    os.mknod(path, 0o666 | stat.S_IFCHR, os.stat("/dev/full").st_rdev)


def test_nvidia_gpu_devices_are_the_numbered_character_devices_in_number_order(tmp_path: Path) -> None:
    for name in ("nvidia10", "nvidia2", "nvidia0", "nvidiactl", "nvidia-uvm"):
        _char_device(tmp_path / name)
    (tmp_path / "nvidia3").write_text("a regular file is no GPU")

    assert nvidia_gpu_devices(tmp_path) == [tmp_path / "nvidia0", tmp_path / "nvidia2", tmp_path / "nvidia10"]


def test_the_first_node_gets_the_real_gpus_and_the_others_their_fake_ones(tmp_path: Path) -> None:
    spec = DevClusterSpec(dir=tmp_path, nodes=2, gpus_per_node=4, real_gpus=True)
    nodes = [{"name": "node1", "port": 1, "gpus": ["/dev/nvidia0"]},
             {"name": "node2", "port": 2, "gpus": [f"{tmp_path}/dev/node2/gpu{g}" for g in range(4)]}]

    files = render_config_files(spec, tmp_path, (22, 5), nodes)

    node_lines = [line for line in files["slurm.conf"].splitlines() if line.startswith("NodeName=")]
    assert "Gres=gpu:1" in node_lines[0] and "Gres=gpu:4" in node_lines[1]
    gres = [line for line in files["gres.conf"].splitlines() if line.startswith("NodeName=")]
    assert gres[0] == "NodeName=node1 Name=gpu File=/dev/nvidia0"
    assert [line.split()[0] for line in gres[1:]] == ["NodeName=node2"] * 4


def test_real_gpus_on_a_host_without_any_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_module, "nvidia_gpu_devices", lambda: [])
    cluster = DevCluster(DevClusterSpec(dir=tmp_path, real_gpus=True))

    with pytest.raises(DevClusterError, match=r"--real-gpus: this host has no NVIDIA GPU device files"):
        cluster._prepare_files(lambda _msg: None)
