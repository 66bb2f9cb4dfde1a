"""The node agent on a real NVIDIA GPU, reporting to the controller's real API (served as the
controller serves it, without Slurm): the node is heard, no GPU is cordoned, and the launch
pre-flight reads the GPU's real free memory. Skipped where NVML cannot initialise."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slurm_elastic.controller.app import create_controller_app
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.serve import ApiServer
from slurm_elastic.gpu.nvml import NvmlSource
from slurm_elastic.slurm.cli_backend import SlurmCli

pytestmark = pytest.mark.gpu

NODE = "gpu-test-node"
TOKEN = "gpu-test-token"


@pytest.fixture
def gpu_count(nvml_source: NvmlSource) -> int:
    return len(nvml_source.sample(0.0).gpus)


@pytest.fixture
def controller(tmp_path: Path, gpu_count: int) -> Iterator[tuple[Controller, str, Path]]:
    config = parse_config({"autoscaler": {"min_workers": 0}})
    ctl = Controller(config, 1, SlurmCli(timeout_s=5), tmp_path, gpus_by_node={NODE: tuple(range(gpu_count))})
    server = ApiServer(create_controller_app(ctl, TOKEN), "127.0.0.1")
    server.start()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    try:
        yield ctl, server.url, token_file
    finally:
        server.stop()


def run_agent(*options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from slurm_elastic.cli import main; main()", "agent", "--node", NODE,
                           *options], capture_output=True, text=True, timeout=60)


def controller_status(url: str) -> dict[str, Any]:
    resp = httpx.get(url + "/controller/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    resp.raise_for_status()
    answer: dict[str, Any] = resp.json()
    return answer


def test_the_agent_reports_the_real_gpus_and_none_is_cordoned(controller: tuple[Controller, str, Path],
                                                               gpu_count: int) -> None:
    ctl, url, token_file = controller
    assert NODE in controller_status(url)["unknown_health_nodes"]

    done = run_agent("--source", "auto", "--controller-url", url, "--token-file", str(token_file), "--once")

    assert done.returncode == 0, done.stderr
    status = controller_status(url)
    assert status["unknown_health_nodes"] == [] and status["cordoned_gpus"] == []
    for gpu in range(gpu_count):
        sample = ctl.state.cordons.latest_sample(NODE, gpu)
        assert sample is not None and sample.memory_total_mb and sample.memory_free_mb is not None
        ok, why = ctl.state.cordons.preflight_ok(NODE, gpu, required_free_mb=1)
        assert ok, why
        ok, why = ctl.state.cordons.preflight_ok(NODE, gpu, required_free_mb=sample.memory_total_mb + 1)
        assert not ok and f"{NODE}:{gpu} has {sample.memory_free_mb} MiB free" in why
        print(f"{NODE}:{gpu} {sample.uuid} {sample.temperature_c} C, {sample.memory_free_mb} of "
              f"{sample.memory_total_mb} MiB free, reasons {sorted(sample.clock_event_reasons or ())}")


def test_agent_print_with_source_auto_reads_nvml(gpu_count: int) -> None:
    done = run_agent("--source", "auto", "--print")

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["source"] == "nvml" and len(report["gpus"]) == gpu_count and report["errors"] == []
