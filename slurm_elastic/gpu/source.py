"""The interface every telemetry source implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from slurm_elastic.core.health import GpuSample


@dataclass
class Reading:
    """One sample of all GPUs a source can see on its node, plus source-level errors."""

    gpus: list[GpuSample]
    errors: list[str] = field(default_factory=list)


class TelemetrySource(Protocol):
    """Samples this node's GPUs. ``sample`` never raises for a GPU or field that fails."""

    @property
    def name(self) -> str:
        """Short name for reports: ``nvml``, ``inject``."""

    def sample(self, now_s: float) -> Reading: ...

    def close(self) -> None: ...
