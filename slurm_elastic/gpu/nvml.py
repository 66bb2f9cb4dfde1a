"""NVML telemetry with nvidia-ml-py (``import pynvml``), robust to failing GPUs and fields.

Every field of every GPU is read in its own ``try``: a field NVML does not support (ECC on
a consumer card) or a GPU that errors is recorded in ``GpuSample.errors`` and the rest is
still read. ``NVMLError_GpuIsLost`` (and "requires reset") set ``lost=True``.

API generations handled (resolved by name, never by version number):

* clock reasons: ``nvmlDeviceGetCurrentClocksEventReasons`` (bindings >= 12.535, drivers
  >= R535) is preferred; ``nvmlDeviceGetCurrentClocksThrottleReasons`` (deprecated, "removed
  in CUDA 14.0") is the fallback when the binding lacks the new function or the driver
  answers ``FUNCTION_NOT_FOUND``. Bit constants are looked up as ``nvmlClocksEventReason*``
  then ``nvmlClocksThrottleReason*``; the NVML header values are the last resort (the
  ``BoardLimit`` and ``Reliability`` bits exist only under the Throttle name in 13.x).
* temperature: ``nvmlDeviceGetTemperatureV`` (13.x) then ``nvmlDeviceGetTemperature``.

GPU index "as Slurm numbers it": NVML enumerates GPUs in PCI bus order (what
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` gives and how Slurm numbers GPUs with ``AutoDetect=nvml``
or a gres.conf listing ``/dev/nvidia[0-N]`` in bus order). When the agent step sees all of
the node's GPUs, NVML index = Slurm index. When cgroups show the step only some GPUs, NVML
renumbers them 0..k-1, and we map them onto the sorted Slurm indexes in ``SLURM_STEP_GPUS``
(or ``SLURM_JOB_GPUS``, or an all-integer ``CUDA_VISIBLE_DEVICES``) when the count matches.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from slurm_elastic.core.health import CLOCK_EVENT_FLAGS, GpuSample
from slurm_elastic.errors import TelemetryError
from slurm_elastic.gpu.source import Reading

log = logging.getLogger(__name__)

_MIB = 1024 * 1024

# our flag -> (NVML constant suffix, header value). Order and values: nvml.h.
_CLOCK_EVENT_SUFFIX: dict[str, tuple[str, int]] = {
    "idle": ("GpuIdle", 0x1),
    "applications_clocks": ("ApplicationsClocksSetting", 0x2),
    "sw_power_cap": ("SwPowerCap", 0x4),
    "hw_slowdown": ("HwSlowdown", 0x8),
    "sync_boost": ("SyncBoost", 0x10),
    "sw_thermal_slowdown": ("SwThermalSlowdown", 0x20),
    "hw_thermal_slowdown": ("HwThermalSlowdown", 0x40),
    "hw_power_brake": ("HwPowerBrakeSlowdown", 0x80),
    "display_clock": ("DisplayClockSetting", 0x100),
    "board_limit": ("BoardLimit", 0x200),
    "reliability": ("Reliability", 0x400),
}
assert tuple(_CLOCK_EVENT_SUFFIX) == CLOCK_EVENT_FLAGS

_ERROR_CODES = {  # name in pynvml -> nvml.h value
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_RESET_REQUIRED": 16,
    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH": 25,
}
_OTHER_CONSTANTS = {
    "NVML_TEMPERATURE_GPU": 0,
    "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
    "NVML_VOLATILE_ECC": 0,
    "NVML_AGGREGATE_ECC": 1,
    "NVML_FEATURE_ENABLED": 1,
}


def clock_event_bits(nvml: Any) -> dict[str, int]:
    """Our flag name -> bit, resolved from the module by name (new name, old name, header)."""
    bits = {}
    for flag, (suffix, header_value) in _CLOCK_EVENT_SUFFIX.items():
        for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
            value = getattr(nvml, prefix + suffix, None)
            if isinstance(value, int):
                bits[flag] = value
                break
        else:
            bits[flag] = header_value
    return bits


def decode_clock_events(mask: int, bits: Mapping[str, int]) -> frozenset[str]:
    """A reasons bitmask -> our flag names; unknown bits become ``unknown_0x...``."""
    names = {flag for flag, bit in bits.items() if bit and mask & bit}
    rest = mask & ~_or_all(bits.values())
    bit = 1
    while rest:
        if rest & bit:
            names.add(f"unknown_0x{bit:x}")
            rest &= ~bit
        bit <<= 1
    return frozenset(names)


def _or_all(values: Any) -> int:
    out = 0
    for v in values:
        out |= v
    return out


def slurm_indices(count: int, env: Mapping[str, str]) -> tuple[list[int], str | None]:
    """Slurm's index for each NVML index ``0..count-1``, and a note when we had to guess."""
    for var in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        ids = _int_list(env.get(var, ""))
        if ids is not None and len(ids) == count:
            return sorted(ids), None
    note = None
    step = _int_list(env.get("SLURM_STEP_GPUS", "") or env.get("SLURM_JOB_GPUS", ""))
    if step is not None and len(step) > count:
        note = f"NVML sees {count} GPUs but Slurm allocated {len(step)}; using NVML indexes"
    return list(range(count)), note


def _int_list(text: str) -> list[int] | None:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        return None
    return [int(p) for p in parts]


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlSource:
    """Samples every GPU NVML shows this process. ``nvml`` is the pynvml module (a stub in
    tests); ``env`` defaults to ``os.environ``."""

    name = "nvml"

    def __init__(
        self, node: str, nvml: Any | None = None, env: Mapping[str, str] | None = None
    ) -> None:
        self.node = node
        self._nvml = nvml
        self._env = env if env is not None else os.environ
        self._open = False
        self._bits: dict[str, int] = {}
        self._const: dict[str, int] = {}

    # ---- life cycle

    def open(self) -> None:
        """``nvmlInit``; raises ``TelemetryError`` when NVML (library, driver) is unusable."""
        if self._open:
            return
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
        except Exception as exc:
            raise TelemetryError(f"NVML init failed: {exc}") from exc
        nvml = self._nvml
        self._bits = clock_event_bits(nvml)
        self._const = {
            k: _int_attr(nvml, k, v) for k, v in {**_ERROR_CODES, **_OTHER_CONSTANTS}.items()
        }
        self._open = True

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        try:
            self._nvml.nvmlShutdown()  # type: ignore[union-attr]
        except Exception as exc:  # shutting down must not fail the agent
            log.debug("nvmlShutdown: %s", exc)

    def __enter__(self) -> NvmlSource:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- sampling

    def sample(self, now_s: float) -> Reading:
        """Read all GPUs. Never raises: what failed is in the errors."""
        try:
            self.open()
        except TelemetryError as exc:
            return Reading([], [str(exc)])
        nvml = self._nvml
        assert nvml is not None
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:
            self.close()  # re-init next time (driver reloaded, NVML uninitialised)
            return Reading([], [f"nvmlDeviceGetCount: {exc}"])
        indices, note = slurm_indices(count, self._env)
        errors = [note] if note else []
        gpus = []
        for nvml_index in range(count):
            try:
                gpus.append(self._sample_device(nvml_index, indices[nvml_index]))
            except Exception as exc:  # belt and braces: one GPU never stops the rest
                gpus.append(GpuSample(self.node, indices[nvml_index], errors=[f"sample: {exc!r}"]))
        bus_ids = [g.pci_bus_id.lower() for g in gpus if g.pci_bus_id]
        if len(bus_ids) == len(gpus) and bus_ids != sorted(bus_ids):
            errors.append("NVML order is not PCI bus order; Slurm indexes may not match")
        return Reading(gpus, errors)

    def _sample_device(self, nvml_index: int, slurm_index: int) -> GpuSample:
        nvml: Any = self._nvml
        c = self._const
        errors: list[str] = []
        lost = False
        values: dict[str, Any] = {}

        def read(field: str, fn: Callable[[], Any]) -> Any:
            nonlocal lost
            if lost:
                return None
            try:
                return fn()
            except Exception as exc:
                code = getattr(exc, "value", None)
                if code in (c["NVML_ERROR_GPU_IS_LOST"], c["NVML_ERROR_RESET_REQUIRED"]):
                    lost = True
                errors.append(f"{field}: {exc}")
                return None

        handle = read("handle", lambda: nvml.nvmlDeviceGetHandleByIndex(nvml_index))
        if handle is None:
            return GpuSample(self.node, slurm_index, lost=lost, errors=errors)

        uuid = read("uuid", lambda: _text(nvml.nvmlDeviceGetUUID(handle)))
        pci = read("pci_bus_id", lambda: _text(nvml.nvmlDeviceGetPciInfo(handle).busId))
        values["temperature_c"] = read("temperature_c", lambda: float(self._temperature(handle)))
        mask = read("clock_event_reasons", lambda: int(self._clock_reasons(handle)))
        if mask is not None:
            values["clock_event_reasons"] = decode_clock_events(mask, self._bits)
        mem = read("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        if mem is not None:
            values["memory_used_mb"] = int(mem.used) // _MIB
            values["memory_total_mb"] = int(mem.total) // _MIB
        util = read("utilization_pct", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        if util is not None:
            values["utilization_pct"] = float(util.gpu)
        mw = read("power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        if mw is not None:
            values["power_w"] = int(mw) / 1000.0
        unc = c["NVML_MEMORY_ERROR_TYPE_UNCORRECTED"]
        values["ecc_uncorrectable_volatile"] = read(
            "ecc_uncorrectable_volatile",
            lambda: int(nvml.nvmlDeviceGetTotalEccErrors(handle, unc, c["NVML_VOLATILE_ECC"])),
        )
        values["ecc_uncorrectable_aggregate"] = read(
            "ecc_uncorrectable_aggregate",
            lambda: int(nvml.nvmlDeviceGetTotalEccErrors(handle, unc, c["NVML_AGGREGATE_ECC"])),
        )
        pending = read(
            "retired_pages_pending", lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)
        )
        if pending is not None:
            values["retired_pages_pending"] = int(pending) == c["NVML_FEATURE_ENABLED"]
        rows = read("remapped_rows", lambda: nvml.nvmlDeviceGetRemappedRows(handle))
        if rows is not None:
            _corr, _unc, rows_pending, rows_failure = rows
            values["remapped_rows_pending"] = bool(rows_pending)
            values["remapped_rows_failure"] = bool(rows_failure)
        return GpuSample(
            self.node,
            slurm_index,
            uuid=uuid or "",
            pci_bus_id=pci,
            lost=lost,
            errors=errors,
            **values,
        )

    def _temperature(self, handle: Any) -> Any:
        gpu = self._const["NVML_TEMPERATURE_GPU"]
        return self._first_available(
            handle,
            [
                ("nvmlDeviceGetTemperatureV", (gpu,)),
                ("nvmlDeviceGetTemperature", (gpu,)),
            ],
        )

    def _clock_reasons(self, handle: Any) -> Any:
        return self._first_available(
            handle,
            [
                ("nvmlDeviceGetCurrentClocksEventReasons", ()),
                ("nvmlDeviceGetCurrentClocksThrottleReasons", ()),
            ],
        )

    def _first_available(self, handle: Any, calls: list[tuple[str, tuple[Any, ...]]]) -> Any:
        """Call the first function the binding has and the driver implements."""
        fallback_codes = (
            self._const["NVML_ERROR_FUNCTION_NOT_FOUND"],
            self._const["NVML_ERROR_ARGUMENT_VERSION_MISMATCH"],
        )
        last: Exception | None = None
        for name, args in calls:
            fn = getattr(self._nvml, name, None)
            if fn is None:
                continue
            try:
                return fn(handle, *args)
            except Exception as exc:
                if getattr(exc, "value", None) not in fallback_codes:
                    raise
                last = exc
        if last is not None:
            raise last
        raise TelemetryError(f"none of {[n for n, _ in calls]} in this nvidia-ml-py")


def _int_attr(module: Any, name: str, default: int) -> int:
    value = getattr(module, name, default)
    return value if isinstance(value, int) else default
