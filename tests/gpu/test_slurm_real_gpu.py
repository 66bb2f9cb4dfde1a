"""Slurm with the host's real NVIDIA GPUs (`slurm-elastic devcluster up --real-gpus`, one node):
a step given a GPU computes on it and sees no other, a step given none cannot open it
(ConstrainDevices=yes with the real driver), the node agent reads the real GPUs inside its step as
the controller launches it, the controller places workers on them and hears their agent, and the
admin prolog reads them before a job, judged by the job's rules. Skipped without root, an NVIDIA
GPU device file, or Slurm's daemons."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec
from slurm_elastic.devcluster.devices import nvidia_gpu_devices
from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.runner import require_binary, run_command
from tests.cluster.controller_harness import start_controller_job, stop_controller_job, wait_for

pytestmark = pytest.mark.gpu

NODE = "gpunode1"
CUDA_WORKER = Path(__file__).with_name("cuda_worker.py")
REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, os
seen = {"step_gpus": os.environ.get("SLURM_STEP_GPUS"), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
opened = {}
for name in sorted(p for p in os.listdir("/dev") if p.startswith("nvidia") and p[6:].isdigit()):
    try:
        os.close(os.open("/dev/" + name, os.O_RDWR))
        opened[name] = "ok"
    except OSError as exc:
        opened[name] = exc.strerror
seen["opened"] = opened
try:
    import pynvml
    pynvml.nvmlInit()
    seen["nvml_uuids"] = [str(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)))
                          for i in range(pynvml.nvmlDeviceGetCount())]
except Exception as exc:
    seen["nvml_error"] = repr(exc)
try:
    import torch
    seen["torch_devices"] = torch.cuda.device_count()
    if seen["torch_devices"]:
        ones = torch.ones(1024, 1024, device="cuda")
        seen["matmul"] = float((ones @ ones)[0, 0])
except Exception as exc:
    seen["torch_error"] = repr(exc)
print(json.dumps(seen))
"""


def host_gpu_uuids() -> list[str]:
    """nvidia-smi's UUIDs, outside Slurm, in its index order."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    if os.geteuid() != 0 or not nvidia_gpu_devices():
        pytest.skip("needs root and an NVIDIA GPU device file (/dev/nvidia0)")
    try:
        for daemon in ("slurmctld", "slurmd"):
            require_binary(daemon)
    except SlurmError as exc:
        pytest.skip(f"no Slurm here: {exc}")
    directory = tmp_path_factory.mktemp("gpu-devcluster")
    hooks = hook_wrappers(directory)
    cluster = DevCluster(DevClusterSpec(dir=directory, nodes=1, real_gpus=True, node_prefix="gpunode",
                                        cluster_name="gpudev", ctld_port=24817, node_base_port=24901,
                                        prolog=hooks["prolog"], epilog=hooks["epilog"], first_job_id=6_000_000))
    before = {name: os.environ.get(name) for name in ("SLURM_CONF", "SLURM_ELASTIC_HOOKS_CONFIG")}
    cluster.up(wait_s=90, progress=lambda line: print(f"devcluster: {line}"))
    os.environ["SLURM_CONF"] = str(cluster.conf_path)
    os.environ["SLURM_ELASTIC_HOOKS_CONFIG"] = str(directory / "hooks.toml")  # the controller reads the prolog's
    try:
        yield cluster
    finally:
        cluster.down()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def hook_wrappers(directory: Path) -> dict[str, str]:
    """The admin hooks with NVML (source auto), as slurmd runs them: a minimal environment, so the
    wrappers say where Python, the package and the hooks' config are."""
    (directory / "hooks.toml").write_text(f'node_state_dir = "{directory}/node-state"\n'
                                          f'log_file = "{directory}/hooks.log"\nsource = "auto"\n')
    paths = {}
    for hook in ("prolog", "epilog"):
        wrapper = directory / f"{hook}.sh"
        wrapper.write_text(f"#!/bin/bash\nexport SLURM_ELASTIC_PYTHON={sys.executable} "
                           f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}:{REPO}\n"
                           f"export SLURM_ELASTIC_HOOKS_CONFIG={directory}/hooks.toml\n"
                           f"exec {REPO}/sbin/slurm-elastic-{hook}\n")
        wrapper.chmod(0o755)
        paths[hook] = str(wrapper)
    return paths


def probe(*srun_options: str) -> dict[str, Any]:
    done = run_command(["srun", "-N1", "-w", NODE, "--time=5", *srun_options, sys.executable, "-c", PROBE],
                       timeout_s=180)
    seen: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"srun {' '.join(srun_options) or '(no GPU)'}: {seen}")
    return seen


def test_a_step_computes_on_the_gpu_it_was_given_and_a_step_without_one_cannot_open_it(gpu_cluster: DevCluster) -> None:
    uuids = host_gpu_uuids()
    given = probe("--gres=gpu:1")
    index = int(given["step_gpus"])
    assert given["opened"][f"nvidia{index}"] == "ok"
    assert [state for name, state in given["opened"].items() if name != f"nvidia{index}"] == \
        ["Operation not permitted"] * (len(uuids) - 1)
    assert given["nvml_uuids"] == [uuids[index]]
    assert given["torch_devices"] == 1 and given["matmul"] == 1024.0

    none = probe()
    assert set(none["opened"].values()) == {"Operation not permitted"}
    assert none.get("torch_devices", 0) == 0 and not none.get("nvml_uuids")


def test_the_node_agent_reads_every_real_gpu_inside_its_step(gpu_cluster: DevCluster) -> None:
    uuids = host_gpu_uuids()
    done = run_command(["srun", "-N1", "-w", NODE, "--time=5", "--overlap", f"--gres=gpu:{len(uuids)}",
                        sys.executable, "-m", "slurm_elastic", "agent", "--print", "--source", "auto", "--node", NODE],
                       timeout_s=180)
    report = json.loads(done.stdout)
    print(json.dumps(report["gpus"], indent=1))
    assert report["source"] == "nvml" and report["errors"] == []
    assert [(gpu["index"], gpu["uuid"]) for gpu in report["gpus"]] == list(enumerate(uuids))


def test_the_controller_places_workers_on_the_real_gpus_and_hears_their_agent(gpu_cluster: DevCluster,
                                                                              tmp_path: Path) -> None:
    uuids = host_gpu_uuids()
    job = start_controller_job(gpu_cluster, tmp_path, nodes=1, gpus_per_node=len(uuids),
                               agent={"enabled": True, "source": "nvml", "interval_s": 1.0},
                               workers={"initial_workers": len(uuids), "start_timeout_s": 120.0,
                                        "command": [sys.executable, str(CUDA_WORKER)]})
    try:
        try:
            job.active(len(uuids), timeout_s=120)
        except AssertionError as exc:
            agent_log = job.state_dir / "logs" / f"agent-{NODE}.out"
            raise AssertionError(f"{exc}\nlast decision: {job.status()['last_decision']}\nagent: "
                                 f"{agent_log.read_text()[-2000:] if agent_log.exists() else '(no log)'}") from None
        wait_for(lambda: not job.status()["unknown_health_nodes"], 60, "the node's agent to be heard")
        status = job.status()
        assert status["cordoned_gpus"] == []
        def cuda_checks() -> list[dict[str, Any]] | None:
            found = [e for e in job.events() if e["event"] == "cuda"]
            return found if len(found) == len(uuids) else None
        seen = wait_for(cuda_checks, 60, "every worker's CUDA check")
        print(json.dumps(seen, indent=1))
        assert all(e["torch_devices"] == 1 and e["matmul"] == 1024.0 for e in seen)
        assert sorted(u for e in seen for u in e["nvml_uuids"]) == sorted(uuids)  # each worker its own GPU
    finally:
        stop_controller_job(job)


def test_the_prolog_reads_the_real_gpu_and_the_controller_judges_it_by_the_jobs_rules(gpu_cluster: DevCluster,
                                                                                     tmp_path: Path) -> None:
    """The prolog (NVML, before the job, as root) records the real GPU; a job whose rules no GPU
    passes (at most 1 C) gets it cordoned "before the job" by the controller, and no worker there
    (agents off: only the prolog's sample judges it)."""
    uuids = host_gpu_uuids()
    job = start_controller_job(gpu_cluster, tmp_path, nodes=1, gpus_per_node=len(uuids),
                               agent={"enabled": False}, health={"max_temperature_c": 1.0},
                               workers={"initial_workers": 1})
    try:
        recorded = json.loads(next(gpu_cluster.dir.glob(f"node-state/{job.job_id}/gpu-health-{NODE}.json")).read_text())
        print(json.dumps(recorded, indent=1)[:1500])
        assert recorded["report"]["source"] == "nvml" and [g["uuid"] for g in recorded["report"]["gpus"]] == uuids
        cordons = {(c["node"], c["gpu"]): c for c in job.status()["cordoned_gpus"]}
        assert sorted(cordons) == [(NODE, gpu) for gpu in range(len(uuids))]
        assert all(c["reason"].startswith("before the job: temperature_c=") and c["reason"].endswith(">1")
                   for c in cordons.values()), cordons
        assert not [w for w in job.status()["workers"] if w["state"] == "ACTIVE" and not w["placeholder"]]
    finally:
        stop_controller_job(job)
