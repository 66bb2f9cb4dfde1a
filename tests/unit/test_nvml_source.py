"""NvmlSource driven through a stub standing in for the pynvml module (both API generations)."""

from __future__ import annotations

import types
from typing import Any

import pytest

from slurm_elastic.gpu.nvml import NvmlSource, clock_event_bits, decode_clock_events, slurm_indices

MIB = 1024 * 1024
ERR_NAMES = {
    3: "Not Supported",
    9: "Driver Not Loaded",
    13: "Function Not Found",
    15: "GPU is lost",
}


class NVMLError(Exception):
    """Like pynvml's: carries ``value``, prints the NVML message."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return ERR_NAMES.get(self.value, f"NVML error {self.value}")


def gpu_spec(**kw: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "uuid": b"GPU-aaaa",
        "pci": b"00000000:01:00.0",
        "temp": 50,
        "reasons": 0x4,  # SwPowerCap: normal under load
        "mem": (1000 * MIB, 80000 * MIB),
        "util": 97,
        "power_mw": 350_000,
        "ecc_vol": 0,
        "ecc_agg": 0,
        "pending": 0,
        "rows": (0, 0, 0, 0),
    }
    spec.update(kw)
    return spec


def make_nvml(gpus: list[dict[str, Any]], generation: str = "event", init_error: int = 0) -> Any:
    """A module object with pynvml's names. ``generation``: ``event`` (>= 12.535 binding),
    ``throttle`` (11.x binding: old names only), ``event-old-driver`` (new binding, driver
    without the new function: FUNCTION_NOT_FOUND)."""
    m = types.ModuleType("fake_pynvml")
    m.NVMLError = NVMLError  # type: ignore[attr-defined]
    m.NVML_ERROR_GPU_IS_LOST = 15  # type: ignore[attr-defined]
    m.NVML_ERROR_FUNCTION_NOT_FOUND = 13  # type: ignore[attr-defined]
    m.calls = []  # type: ignore[attr-defined]
    suffixes = {
        "GpuIdle": 0x1, "ApplicationsClocksSetting": 0x2, "SwPowerCap": 0x4, "HwSlowdown": 0x8,
        "SyncBoost": 0x10, "SwThermalSlowdown": 0x20, "HwThermalSlowdown": 0x40,
        "HwPowerBrakeSlowdown": 0x80, "DisplayClockSetting": 0x100,
    }  # fmt: skip
    for suffix, bit in suffixes.items():
        setattr(m, "nvmlClocksThrottleReason" + suffix, bit)
        if generation != "throttle":
            setattr(m, "nvmlClocksEventReason" + suffix, bit)

    def val(i: int, key: str) -> Any:
        v = gpus[i][key]
        if isinstance(v, Exception):
            raise v
        return v

    def handle(i: int) -> int:
        m.calls.append("handle")  # type: ignore[attr-defined]
        if isinstance(gpus[i].get("handle"), Exception):
            raise gpus[i]["handle"]
        return i

    def init() -> None:
        m.calls.append("init")  # type: ignore[attr-defined]
        if init_error:
            raise NVMLError(init_error)

    m.nvmlInit = init  # type: ignore[attr-defined]
    m.nvmlShutdown = lambda: m.calls.append("shutdown")  # type: ignore[attr-defined]
    m.nvmlDeviceGetCount = lambda: len(gpus)  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = handle  # type: ignore[attr-defined]
    m.nvmlDeviceGetUUID = lambda h: val(h, "uuid")  # type: ignore[attr-defined]
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=val(h, "pci"))  # type: ignore[attr-defined]
    m.nvmlDeviceGetTemperature = lambda h, sensor: val(h, "temp")  # type: ignore[attr-defined]

    def throttle(h: int) -> int:
        m.calls.append("throttle")  # type: ignore[attr-defined]
        return int(val(h, "reasons"))

    def event(h: int) -> int:
        m.calls.append("event")  # type: ignore[attr-defined]
        if generation == "event-old-driver":
            raise NVMLError(13)
        return int(val(h, "reasons"))

    m.nvmlDeviceGetCurrentClocksThrottleReasons = throttle  # type: ignore[attr-defined]
    if generation != "throttle":
        m.nvmlDeviceGetCurrentClocksEventReasons = event  # type: ignore[attr-defined]

    def mem(h: int) -> Any:
        used, total = val(h, "mem")
        return types.SimpleNamespace(used=used, total=total, free=total - used)

    m.nvmlDeviceGetMemoryInfo = mem  # type: ignore[attr-defined]
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=val(h, "util"), memory=0)  # type: ignore[attr-defined]
    m.nvmlDeviceGetPowerUsage = lambda h: val(h, "power_mw")  # type: ignore[attr-defined]
    m.nvmlDeviceGetTotalEccErrors = lambda h, etype, ctype: val(
        h, "ecc_vol" if ctype == 0 else "ecc_agg"
    )  # type: ignore[attr-defined]
    m.nvmlDeviceGetRetiredPagesPendingStatus = lambda h: val(h, "pending")  # type: ignore[attr-defined]
    m.nvmlDeviceGetRemappedRows = lambda h: val(h, "rows")  # type: ignore[attr-defined]
    return m


@pytest.mark.parametrize("generation", ["event", "throttle", "event-old-driver"])
def test_both_api_generations(generation: str) -> None:
    nvml = make_nvml([gpu_spec(reasons=0x40 | 0x8 | 0x4)], generation)
    reading = NvmlSource("n1", nvml, env={}).sample(0.0)
    [g] = reading.gpus
    assert g.clock_event_reasons == {"hw_thermal_slowdown", "hw_slowdown", "sw_power_cap"}
    assert g.errors == []
    expected_calls = {
        "event": ["event"],
        "throttle": ["throttle"],
        "event-old-driver": ["event", "throttle"],
    }
    assert [c for c in nvml.calls if c in ("event", "throttle")] == expected_calls[generation]


def test_fields_are_read_and_converted() -> None:
    nvml = make_nvml([gpu_spec(ecc_vol=2, pending=1, rows=(5, 1, 1, 0))])
    [g] = NvmlSource("n1", nvml, env={}).sample(0.0).gpus
    assert (g.node, g.index, g.uuid, g.pci_bus_id) == ("n1", 0, "GPU-aaaa", "00000000:01:00.0")
    assert g.temperature_c == 50.0
    assert (g.memory_used_mb, g.memory_total_mb, g.memory_free_mb) == (1000, 80000, 79000)
    assert g.utilization_pct == 97.0 and g.power_w == 350.0
    assert g.ecc_uncorrectable_volatile == 2 and g.ecc_uncorrectable_aggregate == 0
    assert g.retired_pages_pending is True
    assert g.remapped_rows_pending is True and g.remapped_rows_failure is False
    assert not g.lost


def test_lost_gpu_and_unsupported_field_do_not_stop_the_rest() -> None:
    nvml = make_nvml(
        [
            gpu_spec(
                uuid=b"GPU-0", ecc_vol=NVMLError(3), ecc_agg=NVMLError(3), pending=NVMLError(3)
            ),
            gpu_spec(uuid=b"GPU-1", pci=b"00000000:02:00.0", temp=NVMLError(15)),
            gpu_spec(uuid=b"GPU-2", pci=b"00000000:03:00.0", handle=NVMLError(15)),
            gpu_spec(uuid=b"GPU-3", pci=b"00000000:04:00.0", util=RuntimeError("ctypes oops")),
        ]
    )
    reading = NvmlSource("n1", nvml, env={}).sample(0.0)
    g0, g1, g2, g3 = reading.gpus
    assert not g0.lost and g0.ecc_uncorrectable_volatile is None and g0.temperature_c == 50.0
    assert "ecc_uncorrectable_volatile: Not Supported" in g0.errors
    assert g0.retired_pages_pending is None and g0.remapped_rows_pending is False
    assert g1.lost and g1.uuid == "GPU-1" and g1.temperature_c is None
    assert g1.errors == ["temperature_c: GPU is lost"]  # stops reading a lost GPU
    assert g1.memory_total_mb is None
    assert g2.lost and g2.index == 2 and g2.errors == ["handle: GPU is lost"]
    assert g3.utilization_pct is None and g3.temperature_c == 50.0
    assert g3.errors == ["utilization_pct: ctypes oops"]


def test_init_failure_is_reported_and_retried() -> None:
    nvml = make_nvml([gpu_spec()], init_error=9)
    src = NvmlSource("n1", nvml, env={})
    reading = src.sample(0.0)
    assert reading.gpus == [] and reading.errors == ["NVML init failed: Driver Not Loaded"]
    src.sample(1.0)
    assert nvml.calls.count("init") == 2
    src.close()
    assert "shutdown" not in nvml.calls


def test_open_close_context() -> None:
    nvml = make_nvml([gpu_spec()])
    with NvmlSource("n1", nvml, env={}) as src:
        assert len(src.sample(0.0).gpus) == 1
    assert nvml.calls.count("init") == 1 and nvml.calls[-1] == "shutdown"


def test_slurm_index_mapping_from_env() -> None:
    specs = [gpu_spec(pci=f"00000000:0{i + 1}:00.0".encode()) for i in range(2)]
    nvml = make_nvml(specs)
    reading = NvmlSource("n1", nvml, env={"SLURM_STEP_GPUS": "6,2"}).sample(0.0)
    assert [g.index for g in reading.gpus] == [2, 6]
    assert reading.errors == []


@pytest.mark.parametrize(
    ("count", "env", "expected", "noted"),
    [
        (4, {}, [0, 1, 2, 3], False),
        (2, {"SLURM_STEP_GPUS": "3,1"}, [1, 3], False),
        (2, {"SLURM_JOB_GPUS": "4,5"}, [4, 5], False),
        (2, {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_STEP_GPUS": "5,7"}, [5, 7], False),
        (2, {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}, [0, 1], False),
        (4, {"SLURM_STEP_GPUS": "1"}, [0, 1, 2, 3], False),  # agent sees all GPUs
        (1, {"SLURM_STEP_GPUS": "1,2"}, [0], True),
    ],
)
def test_slurm_indices(count: int, env: dict[str, str], expected: list[int], noted: bool) -> None:
    indices, note = slurm_indices(count, env)
    assert indices == expected and (note is not None) == noted


def test_pci_order_mismatch_is_noted() -> None:
    nvml = make_nvml([gpu_spec(pci=b"00000000:02:00.0"), gpu_spec(pci=b"00000000:01:00.0")])
    assert "PCI bus order" in NvmlSource("n1", nvml, env={}).sample(0.0).errors[0]


def test_clock_event_bits_resolve_by_name_with_header_fallback() -> None:
    old = make_nvml([], "throttle")
    bits = clock_event_bits(old)
    assert bits["hw_thermal_slowdown"] == 0x40 and bits["reliability"] == 0x400
    assert decode_clock_events(0x1 | 0x100 | 0x800, bits) == {
        "idle",
        "display_clock",
        "unknown_0x800",
    }
    assert decode_clock_events(0, bits) == frozenset()


def test_real_binding_constants_match() -> None:
    pynvml = pytest.importorskip("pynvml")
    bits = clock_event_bits(pynvml)
    assert bits["sw_power_cap"] == 0x4 and bits["hw_slowdown"] == 0x8
    assert bits["hw_power_brake"] == 0x80 and bits["sw_thermal_slowdown"] == 0x20
    assert isinstance(pynvml.NVMLError(15), pynvml.NVMLError_GpuIsLost)
    assert pynvml.NVMLError(15).value == 15
