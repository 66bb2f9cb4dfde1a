"""NvmlSource on a real NVIDIA GPU; skipped where NVML cannot initialise."""

from __future__ import annotations

import json

import pytest

from slurm_elastic.client.wire import sample_json
from slurm_elastic.core.health import CLOCK_EVENT_FLAGS, HealthRules, evaluate
from slurm_elastic.gpu.nvml import NvmlSource

pytestmark = pytest.mark.gpu


def test_reads_every_gpu(nvml_source: NvmlSource) -> None:
    reading = nvml_source.sample(0.0)
    print(
        json.dumps(
            {"gpus": [sample_json(g) for g in reading.gpus], "errors": reading.errors}, indent=1
        )
    )
    assert reading.gpus, "NVML initialised but showed no GPU"
    for g in reading.gpus:
        assert g.uuid.startswith(("GPU-", "MIG-")) and not g.lost
        assert g.temperature_c is not None and 0 < g.temperature_c < 130
        assert g.memory_total_mb and g.memory_used_mb is not None
        assert 0 <= g.memory_used_mb <= g.memory_total_mb
        assert g.clock_event_reasons is not None
        assert all(r in CLOCK_EVENT_FLAGS for r in g.clock_event_reasons), g.clock_event_reasons
        assert g.power_w is None or 0 <= g.power_w < 2000
        # a GPU idling in a test should not be cordoned
        assert evaluate(g, HealthRules()) == [], (g.index, sample_json(g))


def test_indexes_follow_nvml_order(nvml_source: NvmlSource) -> None:
    reading = nvml_source.sample(0.0)
    assert [g.index for g in reading.gpus] == list(range(len(reading.gpus)))
