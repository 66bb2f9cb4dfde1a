"""A dev cluster run from a Slurm install prefix: which binaries, which environment, which spec."""

from __future__ import annotations

import os
from pathlib import Path

import jinja2
import pytest

from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec
from slurm_elastic.devcluster.spec import render_config_files
from slurm_elastic.errors import DevClusterError
from slurm_elastic.resources import templates_dir


def fake_prefix(root: Path) -> Path:
    for sub, name in (("sbin", "slurmctld"), ("sbin", "slurmd"), ("bin", "srun"), ("bin", "sinfo")):
        path = root / sub / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    return root


def test_prefix_binaries_and_environment(tmp_path: Path) -> None:
    prefix = fake_prefix(tmp_path / "slurm")
    cluster = DevCluster(DevClusterSpec(dir=tmp_path / "dc", slurm_prefix=str(prefix)))
    assert cluster.binary("slurmctld") == str(prefix / "sbin" / "slurmctld")
    assert cluster.binary("srun") == str(prefix / "bin" / "srun")
    assert cluster.env()["PATH"].split(os.pathsep)[0] == str(prefix / "bin")
    assert f'export PATH="{prefix / "bin"}:$PATH"' in cluster.env_lines()
    with pytest.raises(DevClusterError, match=r"scancel is missing: --slurm-prefix .* is not a Slurm install"):
        cluster.binary("scancel")


def test_without_prefix_nothing_changes(tmp_path: Path) -> None:
    cluster = DevCluster(DevClusterSpec(dir=tmp_path / "dc"))
    assert cluster.env_lines() == f"export SLURM_CONF={cluster.conf_path}\n"
    recorded = DevClusterSpec(dir=tmp_path / "dc").to_json()
    recorded.pop("slurm_prefix")  # a spec recorded before the field existed is the same cluster
    assert DevClusterSpec.from_json(recorded).to_json() == cluster.spec.to_json()


@pytest.mark.parametrize(("version", "unkillable"), [([22, 5], "30"), ([25, 11], "60")])
def test_slurm_conf_follows_the_slurm_version(version: list[int], unkillable: str) -> None:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir() / "devcluster")),
                             undefined=jinja2.StrictUndefined)
    text = env.get_template("slurm.conf.j2").render(
        **{**DevClusterSpec().to_json(), "nodes": []}, cgroup_plugin="cgroup/v1", slurm_version=version)
    assert f"UnkillableStepTimeout={unkillable}\n" in text
    assert ("MailProg=/bin/true" in text) == (version >= [24, 0])


def test_up_with_a_prefix_that_is_no_slurm_install_is_a_clear_error(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from slurm_elastic.cli import main

    result = CliRunner().invoke(main, ["devcluster", "up", "--slurm-prefix", str(tmp_path / "none"),
                                       "--dir", str(tmp_path / "dc"), "--node-prefix", "x"])
    assert result.exit_code != 0
    expected = "is not a Slurm install" if os.geteuid() == 0 else "needs root"
    assert expected in result.output + str(result.exception)
    assert not (tmp_path / "dc").exists()  # nothing started, nothing written


def test_a_second_cluster_numbers_its_jobs_apart(tmp_path: Path) -> None:
    spec = DevClusterSpec(dir=tmp_path / "dc", node_prefix="nodeb", first_job_id=1_000_000)
    conf = render_config_files(spec, tmp_path, (22, 5))["slurm.conf"]
    assert "FirstJobId=1000000\n" in conf and "NodeName=nodeb2 " in conf
    assert "FirstJobId" not in render_config_files(DevClusterSpec(dir=tmp_path / "dc"), tmp_path, (22, 5))["slurm.conf"]
    recorded = DevClusterSpec(dir=tmp_path / "dc").to_json()
    recorded.pop("first_job_id")  # a spec recorded before the field existed: jobs from 1, Slurm's default
    assert DevClusterSpec.from_json(recorded).first_job_id == 1
