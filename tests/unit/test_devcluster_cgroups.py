"""The dev cluster's cgroup preparation: the plugin follows the host's mounts, and on a cgroup v2
host without systemd the slice slurmd's steps go under is made, with Slurm's controllers enabled."""

from __future__ import annotations

from pathlib import Path

from slurm_elastic.devcluster.cgroups import detect_cgroup_plugin, ensure_stepd_slice


def test_the_plugin_is_v1_where_the_v1_devices_controller_is_mounted(tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    v1.write_text("cgroup /sys/fs/cgroup/devices cgroup rw,relatime,devices 0 0\n")
    v2 = tmp_path / "v2"
    v2.write_text("cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0\n")

    assert detect_cgroup_plugin(v1) == "cgroup/v1"
    assert detect_cgroup_plugin(v2) == "cgroup/v2"
    assert detect_cgroup_plugin(tmp_path / "none") == "cgroup/v2"


def test_a_missing_system_slice_is_made_with_the_controllers_the_host_has(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")

    said = ensure_stepd_slice(tmp_path)

    enabled = "+cpuset +cpu +io +memory +pids"
    assert said == f"made {tmp_path / 'system.slice'} (no systemd here) with {enabled}"
    assert (tmp_path / "cgroup.subtree_control").read_text() == enabled
    assert (tmp_path / "system.slice" / "cgroup.subtree_control").read_text() == enabled


def test_where_the_slice_exists_or_there_is_no_cgroup_v2_nothing_changes(tmp_path: Path) -> None:
    assert ensure_stepd_slice(tmp_path) is None
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "system.slice").mkdir()

    assert ensure_stepd_slice(tmp_path) is None
    assert not (tmp_path / "cgroup.subtree_control").exists()
