"""NvmlSource against nvidia-smi, the driver's own reader, idle and under a matrix-product load;
skipped without an NVIDIA driver (and the load test without PyTorch's CUDA)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections import Counter

import pytest

from slurm_elastic.core.health import GpuSample, HealthRules, evaluate
from slurm_elastic.gpu.nvml import NvmlSource, clock_event_bits, decode_clock_events

pytestmark = pytest.mark.gpu

_SMI_FIELDS = ("uuid", "pci.bus_id", "memory.total", "temperature.gpu", "ecc.errors.uncorrected.volatile.total")
_REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # new name, old name

_BURN = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn_like(a)
(a @ b).sum().item()
print("ready", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize()
"""


@pytest.fixture(autouse=True)
def _nvidia_smi() -> None:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi here")


def smi_query(fields: tuple[str, ...]) -> list[list[str]]:
    """One row per GPU of ``nvidia-smi --query-gpu``, values without units."""
    out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return [[v.strip() for v in line.split(",")] for line in out.strip().splitlines()]


def smi_reason_masks() -> list[int]:
    """The active clock event reasons of each GPU as nvidia-smi reads them (a bitmask)."""
    for field in _REASON_FIELDS:
        try:
            return [int(row[0], 16) for row in smi_query((field,))]
        except (subprocess.CalledProcessError, ValueError):
            continue
    pytest.skip("this nvidia-smi reads no clock event reasons")


def test_identity_memory_temperature_and_ecc_match_nvidia_smi(nvml_source: NvmlSource) -> None:
    rows = smi_query(_SMI_FIELDS)
    gpus = nvml_source.sample(time.time()).gpus
    print("nvidia-smi:", rows)
    assert len(rows) == len(gpus)
    for row, gpu in zip(rows, gpus, strict=True):
        uuid, bus_id, memory_total_mb, temperature_c, ecc = row
        assert gpu.uuid == uuid
        assert gpu.pci_bus_id is not None and gpu.pci_bus_id.lower() == bus_id.lower()
        assert gpu.memory_total_mb == int(memory_total_mb)
        assert gpu.temperature_c is not None and abs(gpu.temperature_c - float(temperature_c)) <= 3
        if ecc.isdigit():  # "[N/A]" where ECC is off or unsupported
            assert gpu.ecc_uncorrectable_volatile == int(ecc)


def test_clock_event_reasons_match_nvidia_smi(nvml_source: NvmlSource) -> None:
    """The same reasons, decoded the same way: read back to back until both reads agree in time."""
    bits = clock_event_bits(nvml_source._nvml)
    seen = []
    for _ in range(10):
        masks = smi_reason_masks()
        ours = [g.clock_event_reasons for g in nvml_source.sample(time.time()).gpus]
        theirs = [decode_clock_events(mask, bits) for mask in masks]
        seen.append((theirs, ours))
        if ours == theirs:
            print("reasons:", ours)
            return
        time.sleep(0.2)
    pytest.fail(f"NVML and nvidia-smi never agreed on the clock event reasons: {seen}")


def test_a_gpu_busy_with_matrix_products_reads_busy_and_is_not_cordoned(nvml_source: NvmlSource) -> None:
    """20 s of bf16 8192^3 products: our readings show the load (utilisation, power), nvidia-smi
    agrees on the reasons, and no sample makes a cordon reason under the default rules."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    burn = subprocess.Popen([sys.executable, "-c", _BURN, "25"], stdout=subprocess.PIPE, text=True)
    try:
        assert burn.stdout is not None and burn.stdout.readline().strip() == "ready"
        samples: list[GpuSample] = []
        reasons: Counter[str] = Counter()
        end = time.time() + 20
        while time.time() < end:
            gpu = nvml_source.sample(time.time()).gpus[0]
            samples.append(gpu)
            reasons.update(gpu.clock_event_reasons or {"(none)"})
            time.sleep(0.5)
    finally:
        burn.kill()
        burn.wait()
    peak_util = max(s.utilization_pct or 0 for s in samples)
    peak_power = max(s.power_w or 0 for s in samples)
    peak_temperature = max(s.temperature_c or 0 for s in samples)
    print(f"{len(samples)} samples under load: utilisation peak {peak_util:.0f} %, power peak {peak_power:.0f} W, "
          f"temperature peak {peak_temperature:.0f} C, clock event reasons {dict(reasons)}")
    assert peak_util >= 50, "the load did not show in the readings"
    cordoning = [(s.temperature_c, sorted(s.clock_event_reasons or ()), evaluate(s, HealthRules()))
                 for s in samples if evaluate(s, HealthRules())]
    assert not cordoning, f"a busy, healthy GPU would be cordoned: {cordoning[:5]}"
