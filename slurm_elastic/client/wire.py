"""The request bodies the controller's routes accept, shared by the routes and the clients.

Each model refuses unknown keys and bounds every number.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from slurm_elastic.core.staleness import MAX_VERSION

WORKER_ID = r"^[A-Za-z0-9_]{1,64}$"
ID = r"^[A-Za-z0-9_.:-]{1,128}$"
INT64_MAX = 2**63 - 1  # what the store (SQLite) and the state file's readers hold
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- workers and routers


class Registration(_Body):
    node: str = Field(min_length=1, max_length=256)
    gpus: list[Annotated[int, Field(ge=0, le=1024)]] = Field(default_factory=list, max_length=64)
    step_id: str = Field("", max_length=64)
    pid: Count = 0
    endpoint: str = Field("", max_length=512)
    ready: bool = True


class Heartbeat(_Body):
    busy: bool | None = None
    rollouts: Count | None = None
    busy_s: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False)  # seconds inside rollouts so far
    exit_code: int | None = Field(None, ge=-255, le=255)
    child_pid: Count | None = None
    placeholder: bool | None = None
    outstanding_requests: Count | None = None


class LoadReport(_Body):
    client_id: str = Field(min_length=1, max_length=128)
    outstanding: dict[str, Annotated[int, Field(ge=0, le=1_000_000)]] = Field(default_factory=dict, max_length=10_000)
    sent: Count = 0
    retried: Count = 0
    failed: Count = 0


# --------------------------------------------------------------------------- operators


class ScaleRequest(_Body):
    workers: int = Field(ge=0, le=100_000)


def _printable(text: str) -> str:
    """Refuse control and format characters (terminal escapes, newlines) in text shown to operators."""
    if not text.isprintable():
        raise ValueError("must be printable text (no control characters, newlines or escape codes)")
    return text


class GpuRef(_Body):
    node: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._-]+$")  # a Slurm node name
    gpu: int = Field(ge=0, le=1024)
    reason: Annotated[str, AfterValidator(_printable)] = Field("", max_length=256)


# --------------------------------------------------------------------------- the rollout queue and trainer


class Admission(_Body):
    sequences: int = Field(ge=1, le=100_000)
    worker_id: str = Field(pattern=WORKER_ID, description="the lease is this worker's: only its submits use it")


class TrainerHello(_Body):
    trainer_id: str = Field("trainer", pattern=ID)


class VersionUpdate(_Body):
    version: int = Field(ge=0, le=MAX_VERSION)
    recovered: bool = Field(False, description="the trainer resumed from a checkpoint at this version")
