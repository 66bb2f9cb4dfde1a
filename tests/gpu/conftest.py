"""One NVML session for the real-GPU tests; they are skipped where NVML cannot initialise."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from slurm_elastic.gpu.nvml import NvmlSource


@pytest.fixture(scope="session")
def nvml_source() -> Iterator[NvmlSource]:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        pytest.skip(f"NVML cannot initialise here: {exc}")
    try:
        with NvmlSource("gpu-test-node", pynvml, env={}) as src:
            yield src
    finally:
        pynvml.nvmlShutdown()
