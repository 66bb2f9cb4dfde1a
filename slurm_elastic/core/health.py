"""GPU health: samples and the rules that judge them (pure).

A GPU is named ``(node, gpu)`` where ``gpu`` is the index as Slurm numbers it on that node.
Memory is in MiB (``_mb``), temperature in degrees Celsius, power in watts.

The flow: the per-node agent reports :class:`GpuSample` lists, :func:`evaluate` turns one
sample into cordon reasons under :class:`HealthRules`, and the cordon book
(:mod:`slurm_elastic.core.cordons`) keeps the cordon state per GPU. Reports and the ``[health]``
table are validated at the edges (:mod:`slurm_elastic.client.wire`,
:mod:`slurm_elastic.controller.config_sections`); what arrives here is typed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

GpuKey = tuple[str, int]
"""``(node, gpu index as Slurm numbers it)``."""

CLOCK_EVENT_FLAGS: tuple[str, ...] = (
    "idle",
    "applications_clocks",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake",
    "display_clock",
    "board_limit",
    "reliability",
)
"""Our names for NVML clock event (throttle) reasons, in NVML bit order (0x1 .. 0x400).
Bits we do not know are reported as ``unknown_0x...``."""

DEFAULT_CORDON_CLOCK_EVENTS: frozenset[str] = frozenset(
    {"hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake", "reliability"}
)
"""Clock events that mean a fault. ``sw_power_cap`` (a GPU at its normal power limit under
load), ``idle``, ``applications_clocks``, ``sync_boost``, ``display_clock`` and
``board_limit`` are normal operation and never cordon by default."""



# --------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU. ``None`` means "could not read"; ``errors`` says why."""

    node: str
    index: int
    uuid: str = ""
    temperature_c: float | None = None
    clock_event_reasons: frozenset[str] | None = None
    memory_used_mb: int | None = None
    memory_total_mb: int | None = None
    utilization_pct: float | None = None
    power_w: float | None = None
    ecc_uncorrectable_volatile: int | None = None
    ecc_uncorrectable_aggregate: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    lost: bool = False
    errors: list[str] = field(default_factory=list)
    pci_bus_id: str | None = None

    @property
    def key(self) -> GpuKey:
        return (self.node, self.index)

    @property
    def memory_free_mb(self) -> int | None:
        if self.memory_used_mb is None or self.memory_total_mb is None:
            return None
        return self.memory_total_mb - self.memory_used_mb


@dataclass(frozen=True)
class AgentReport:
    """What one node agent posts: ``{node, sampled_at_s, source, gpus: [...], errors}``."""

    node: str
    sampled_at_s: float
    source: str
    gpus: list[GpuSample]
    errors: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class HealthRules:
    """GPU health rules. Keys of the ``[health]`` config table; see docs/gpu-health.md."""

    max_temperature_c: float = 87.0
    """Cordon when the GPU core temperature is above this."""
    cordon_clock_events: frozenset[str] = DEFAULT_CORDON_CLOCK_EVENTS
    """Clock event reasons that cordon (names from ``CLOCK_EVENT_FLAGS``)."""
    max_ecc_uncorrectable_volatile: int = 0
    """Cordon when volatile (since driver load) uncorrectable ECC errors exceed this."""
    cordon_on_unreadable: bool = True
    """Cordon a GPU whose temperature, clock events and memory all could not be read."""
    healthy_period_s: float = 300.0
    """A health cordon is lifted only after this long of continuous healthy samples."""
    on_unhealthy: Literal["drain", "keep"] = "drain"
    """What happens to a worker running on a GPU that becomes unhealthy."""
    on_node_out: Literal["drain", "keep"] = "drain"
    """What happens to a worker on a node Slurm marks drained, down, failing or rebooting."""
    release_drained_nodes: bool = False
    """Give such a node back to Slurm (shrink the job) once only node agents run there."""
    crash_threshold: int = 3
    """Worker crashes on one GPU within ``crash_window_s`` that cordon it."""
    crash_window_s: float = 600.0
    crash_cordon_s: float = 1800.0
    """A crash cordon lifts by itself after this long (0: only an operator lifts it)."""
    agent_silence_s: float = 30.0
    """A node whose agent was not heard for this long is "health unknown"; a gap this long
    between two samples of a GPU also restarts its healthy period."""


def evaluate(sample: GpuSample, rules: HealthRules) -> list[str]:
    """Reasons to cordon this GPU now (empty list: healthy)."""
    if sample.lost:
        return ["gpu_lost"]
    reasons: list[str] = []
    if sample.clock_event_reasons is not None:
        reasons.extend(sorted(sample.clock_event_reasons & rules.cordon_clock_events))
    if sample.temperature_c is not None and sample.temperature_c > rules.max_temperature_c:
        reasons.append(f"temperature_c={sample.temperature_c:g}>{rules.max_temperature_c:g}")
    ecc = sample.ecc_uncorrectable_volatile
    if ecc is not None and ecc > rules.max_ecc_uncorrectable_volatile:
        reasons.append(f"ecc_uncorrectable_volatile={ecc}")
    if sample.retired_pages_pending:
        reasons.append("retired_pages_pending")
    if sample.remapped_rows_pending:
        reasons.append("remapped_rows_pending")
    if sample.remapped_rows_failure:
        reasons.append("remapped_rows_failure")
    if (
        rules.cordon_on_unreadable
        and sample.temperature_c is None
        and sample.clock_event_reasons is None
        and sample.memory_total_mb is None
    ):
        reasons.append("unreadable")
    return reasons


def parse_gpu_ref(ref: str) -> GpuKey:
    """``"node1:2"`` -> ``("node1", 2)`` (the index in ASCII digits); raises ``ValueError``."""
    node, sep, idx = ref.rpartition(":")
    if not sep or not node or not (idx.isascii() and idx.isdigit()):
        raise ValueError(f"expected NODE:GPU (e.g. node1:2), its GPU index in ASCII digits, got {ref!r}")
    return node, int(idx)
