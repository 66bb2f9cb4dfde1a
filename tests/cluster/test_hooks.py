"""The admin hooks on a dev cluster configured with them (a second small cluster of its own)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from slurm_elastic.core.burst import burst_job_comment, burst_job_name
from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import start_controller_job, stop_controller_job, wait_for

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
LOST_GPU = '[[fault]]\nnode = "hk1"\ngpu = 1\nlost = true\n'




@pytest.fixture
def hooked(tmp_path: Path, devcluster: DevCluster) -> Iterator[tuple[DevCluster, Path]]:
    # slurmd runs hooks with a minimal environment: these wrappers say where Python and the config are
    wrappers = []
    for hook in ("prolog", "epilog"):
        wrapper = tmp_path / f"{hook}.sh"
        wrapper.write_text(f"#!/bin/bash\nexport SLURM_ELASTIC_PYTHON={sys.executable} PYTHONPATH={REPO}\n"
                           f"export SLURM_ELASTIC_HOOKS_CONFIG={tmp_path}/hooks.toml\n"
                           f"exec {REPO}/sbin/slurm-elastic-{hook}\n")
        wrapper.chmod(0o755)
        wrappers.append(str(wrapper))
    write_config(tmp_path, strict=False)
    spec = DevClusterSpec(dir=tmp_path / "dc", nodes=1, gpus_per_node=2, ctld_port=23817, node_base_port=23901,
                          cluster_name="hooks", node_prefix="hk", prolog=wrappers[0], epilog=wrappers[1],
                          first_job_id=4_000_000)
    cluster = DevCluster(spec)
    cluster.up()
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf_path)
    try:
        yield cluster, tmp_path
    finally:
        cluster.down()
        if saved:
            os.environ["SLURM_CONF"] = saved


def write_config(tmp: Path, strict: bool) -> None:
    slurm_bin_dir = Path(shutil.which("squeue") or "/usr/bin/squeue").parent  # the tests' Slurm, as a site names its own
    (tmp / "hooks.toml").write_text(
        f'node_state_dir = "{tmp}/node-state"\nlog_file = "{tmp}/hooks.log"\nsource = "inject"\n'
        f'inject_file = "{tmp}/drill.toml"\ngpus = 2\nstrict = {"true" if strict else "false"}\n'
        f'slurm_bin_dir = "{slurm_bin_dir}"\n')


def submit(cluster: DevCluster) -> int:
    out = run_command(["sbatch", "--parsable", "--nodes=1", "--gres=gpu:2", "--output=/dev/null",
                       "--wrap", "sleep 300"]).stdout
    return int(out.strip().split(";")[0])


def state_of(job_id: int) -> str:
    return run_command(["squeue", "-h", "-j", str(job_id), "-o", "%T"], check=False).stdout.strip()


def leaked(job_id: int) -> subprocess.Popen[bytes]:
    """A process that escaped the job's cgroup but still carries its identity."""
    env = {**os.environ, "SLURM_JOB_ID": str(job_id), "SLURM_ELASTIC_WORKER_ID": "0001"}
    return subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)


def test_prolog_records_health_and_epilog_kills_only_this_jobs_leftovers(hooked: tuple[DevCluster, Path]) -> None:
    cluster, tmp = hooked
    (tmp / "drill.toml").write_text(LOST_GPU)  # not strict: the job runs anyway
    job = submit(cluster)
    wait_for(lambda: state_of(job) == "RUNNING")
    health = json.loads(wait_for(lambda: next((tmp / "node-state").glob(f"{job}/gpu-health-hk1.json"), None)).read_text())
    assert health["node"] == "hk1" and health["definitively_bad"] == {"1": "GPU lost"}
    assert health["unhealthy_by_default_rules"]["1"] and health["unhealthy_by_default_rules"]["0"] == []
    mine, other = leaked(job), leaked(job + 1000)
    try:
        run_command(["scancel", str(job)])
        wait_for(lambda: not state_of(job))
        wait_for(lambda: mine.poll() is not None, 20)  # killed by the epilog
        assert other.poll() is None and psutil.pid_exists(other.pid)  # another job's: untouched
        assert not (tmp / "node-state" / str(job)).exists()
        log = (tmp / "hooks.log").read_text()
        assert f"terminating leftover pid {mine.pid}" in log and f"pid {other.pid}" not in log
    finally:
        other.kill()
        mine.kill()


def test_the_controller_cordons_what_the_prolog_found_by_the_jobs_rules(hooked: tuple[DevCluster, Path],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """80 C passes the default rules (87 C) but not this job's (70 C): the prolog's sample, judged by
    the controller with the job's [health], cordons hk1:1 by "prolog" before any worker goes there."""
    cluster, tmp = hooked
    (tmp / "drill.toml").write_text('[[fault]]\nnode = "hk1"\ngpu = 1\ntemperature_c = 80\n')
    monkeypatch.setenv("SLURM_ELASTIC_HOOKS_CONFIG", str(tmp / "hooks.toml"))  # the batch script inherits it
    job = start_controller_job(cluster, tmp / "ctl", nodes=1, gpus_per_node=2, health={"max_temperature_c": 70.0})
    try:
        prolog = json.loads(next((tmp / "node-state").glob(f"{job.job_id}/gpu-health-hk1.json")).read_text())
        assert prolog["unhealthy_by_default_rules"] == {"0": [], "1": []}
        cordons = job.status()["cordoned_gpus"]
        assert [(c["node"], c["gpu"], c["source"], c["reason"]) for c in cordons] == [
            ("hk1", 1, "prolog", "before the job: temperature_c=80>70")]
        with job.client() as c:
            c.wake_all()
        status = job.active(1, timeout_s=40)  # one worker, on the GPU that passed
        assert [(w["node"], w["gpus"]) for w in status["workers"] if not w["placeholder"]] == [("hk1", [0])]
    finally:
        stop_controller_job(job)


def test_strict_prolog_drains_the_node_on_a_definitively_bad_gpu(hooked: tuple[DevCluster, Path]) -> None:
    cluster, tmp = hooked
    write_config(tmp, strict=True)
    (tmp / "drill.toml").write_text(LOST_GPU)
    job = submit(cluster)
    try:
        wait_for(lambda: "drain" in run_command(["sinfo", "-h", "-N", "-o", "%T"]).stdout, 40)
        reason = run_command(["sinfo", "-h", "-N", "-o", "%E"]).stdout
        assert "rolog" in reason  # "Prolog error"
        assert "GPU lost" in (tmp / "hooks.log").read_text()
    finally:
        run_command(["scancel", str(job)], check=False)
        run_command(["scontrol", "update", "NodeName=hk1", "State=RESUME"], check=False)


def test_a_broken_hook_never_fails_slurm(tmp_path: Path) -> None:
    (tmp_path / "hooks.toml").write_text('gpus = "many"\nlog_file = "/proc/forbidden/log"\n')
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "77", "SLURMD_NODENAME": "n1", "PYTHONPATH": str(REPO),
           "SLURM_ELASTIC_PYTHON": sys.executable, "SLURM_ELASTIC_HOOKS_CONFIG": str(tmp_path / "hooks.toml")}
    for hook in ("prolog", "epilog"):
        result = subprocess.run([str(REPO / "sbin" / f"slurm-elastic-{hook}")], env=env, capture_output=True)
        assert result.returncode == 0, result.stderr
    broken = {**env, "SLURM_ELASTIC_PYTHON": "/nonexistent/python"}
    assert subprocess.run([str(REPO / "sbin" / "slurm-elastic-prolog")], env=broken).returncode == 0


def test_the_epilog_of_a_parent_job_cancels_its_burst_jobs_and_no_other(hooked: tuple[DevCluster, Path]) -> None:
    _cluster, tmp = hooked
    parent = int(run_command(["sbatch", "--parsable", "--gres=gpu:1", "--output=/dev/null",
                              f"--comment=slurm-elastic:{tmp}/state", "--wrap", "sleep 300"]).stdout.split(";")[0])

    def job(name: str, comment: str) -> int:
        return int(run_command(["sbatch", "--parsable", "--output=/dev/null", f"--job-name={name}",
                                f"--comment={comment}", "--wrap", "sleep 300"]).stdout.split(";")[0])
    burst = job(burst_job_name(parent), burst_job_comment(parent))
    look_alike = job(burst_job_name(parent), "someone else's")
    try:
        wait_for(lambda: state_of(parent) == "RUNNING" and state_of(burst) == "RUNNING")
        run_command(["scancel", str(parent)])
        wait_for(lambda: not state_of(burst), 30)  # cancelled by the parent's epilog
        assert state_of(look_alike) == "RUNNING"
        assert f"cancelled burst job {burst} of ended job {parent}" in (tmp / "hooks.log").read_text()
    finally:
        run_command(["scancel", str(parent), str(burst), str(look_alike)], check=False)
