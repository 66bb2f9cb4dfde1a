"""The request bodies the controller's routes accept, shared by the routes and the clients.

Each model refuses unknown keys, values of another JSON type (no numbers as strings, no
booleans or fractions as integers) and numbers that are not finite, and bounds every number and
list (a list over its cap is refused before its items are read, so a huge one costs one error);
:class:`AgentReportBody` also turns a node agent's report into the core's frozen
:class:`~slurm_elastic.core.health.AgentReport` (and back, for the agent that posts it).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from slurm_elastic.core.health import AgentReport, GpuSample
from slurm_elastic.core.limits import MAX_WORKERS
from slurm_elastic.core.staleness import MAX_VERSION

WORKER_ID = r"^[A-Za-z0-9_]{1,64}$"
ID = r"^[A-Za-z0-9_.:-]{1,128}$"
INT64_MAX = 2**63 - 1  # what the store (SQLite) and the state file's readers hold
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
RouterTotal = Annotated[int, Field(ge=0, le=10**15)]  # a router's requests: the sum over 256 fits in int64
GPU_INDEX_MAX = 1024  # the highest GPU index a body may name
NODE_GPUS_MAX = 64  # GPUs one node may report or one worker hold
NODE_NAME = r"^[A-Za-z0-9._-]+$"  # a Slurm node name's characters
NodeName = Annotated[str, Field(min_length=1, max_length=256)]  # a Slurm node name
TEXT_MAX = 4096  # characters of an agent's error message
NOTES_MAX = 64  # messages or flags in one list of an agent's report (a sample reads about 15 fields)
Note = Annotated[str, Field(max_length=TEXT_MAX)]


def _printable(text: str) -> str:
    """Refuse control and format characters (terminal escapes, newlines) in text shown to operators."""
    if not text.isprintable():
        raise ValueError("must be printable text (no control characters, newlines or escape codes)")
    return text


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# --------------------------------------------------------------------------- workers and routers


class Registration(_Body):
    node: str = Field(min_length=1, max_length=256, pattern=NODE_NAME)
    gpus: list[Annotated[int, Field(ge=0, le=GPU_INDEX_MAX)]] = Field(default_factory=list, max_length=NODE_GPUS_MAX)
    step_id: str = Field("", max_length=64, pattern=r"^[A-Za-z0-9._+-]*$")
    pid: Count = 0
    endpoint: Annotated[str, AfterValidator(_printable)] = Field(
        "", max_length=512, pattern=r"^(https?://[^\s/?#@]+(/\S*)?)?$",
        description="servers: where routers reach it, an http:// or https:// URL (empty: not ready)")
    ready: bool = True
    rank: int = Field(0, ge=0, le=65535, description="the task's rank in a multi-node step (SLURM_PROCID); "
                      "above 0 only reports the node and GPUs it holds")
    weights_version: int | None = Field(None, ge=0, le=MAX_VERSION,
                                        description="servers: the published weights version the engine started with")
    command_started: bool = Field(False, description="its command runs already: a server that became ready, or a "
                                  "registration asked again (a restarted controller); no pre-start check applies")


class Heartbeat(_Body):
    busy: bool | None = None
    rollouts: Count | None = None
    busy_s: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False)  # seconds inside rollouts so far
    exit_code: int | None = Field(None, ge=-255, le=255)
    terminated_by_signal: bool | None = None  # the wrapper got SIGTERM or SIGINT before the exit it reports
    not_ready_after_s: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False)  # servers: stopped, not ready
    cannot_start: str | None = Field(None, max_length=1024)  # the command could not be started (why): not its GPU's fault
    child_pid: Count | None = None
    placeholder: bool | None = None
    outstanding_requests: Count | None = None
    liveness_failures: Count | None = None  # servers: failed liveness probes in a row
    leaving: bool | None = None  # a drain signal reached the step itself (an operator, Slurm): a server leaves discovery, a rollout worker drains
    leaving_signal: str | None = Field(None, pattern=r"^SIG[A-Z0-9+]{1,12}$")  # which one (SIGUSR1, SIGTERM, ...)
    rank: int | None = Field(None, ge=0, le=65535, description="another task of a multi-node step (SLURM_PROCID "
                             "above 0) reporting that its command failed; only exit_code counts then")
    instance: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$", description="the SDK process reporting "
                                 "the counts; while another live one of its step holds the worker's counts, its counts are not applied")
    step: str | None = Field(None, pattern=r"^[0-9]{1,20}\.[0-9A-Za-z_+-]{1,32}$", description="the SDK process's "
                             "Slurm step (job.step); the counts of one of another step than the worker's are not applied")
    closing: bool | None = None  # the SDK's last beat (close()): its instance lets go of the worker's counts


class LoadReport(_Body):
    client_id: str = Field(min_length=1, max_length=128)
    outstanding: dict[str, Annotated[int, Field(ge=0, le=1_000_000)]] = Field(default_factory=dict, max_length=10_000)
    sent: RouterTotal = 0
    retried: RouterTotal = 0
    failed: RouterTotal = 0


# --------------------------------------------------------------------------- operators


class ScaleRequest(_Body):
    workers: int = Field(ge=0, le=MAX_WORKERS)


class GpuRef(_Body):
    node: str = Field(min_length=1, max_length=256, pattern=NODE_NAME)
    gpu: int = Field(ge=0, le=GPU_INDEX_MAX)
    reason: Annotated[str, AfterValidator(_printable)] = Field("", max_length=256)


# --------------------------------------------------------------------------- the rollout queue and trainer


class Admission(_Body):
    sequences: int = Field(ge=1, le=100_000)
    worker_id: str = Field(pattern=WORKER_ID, description="the lease is this worker's: only its submits use it")
    admission_id: str | None = Field(None, pattern=r"^[0-9A-Za-z_-]{1,64}$", description=(
        "the worker's name for this admission, one per ask: a repeat of one of its recent ids (a retry whose "
        "answer was lost, or a request that arrives late) gets that id's grant and is not granted again"))
    whole: bool = Field(False, description="grant all the sequences asked for or none (no part of them)")


class AdmissionRelease(_Body):
    sequences: int = Field(ge=1, le=100_000, description="admitted sequences this worker will not submit")
    worker_id: str = Field(pattern=WORKER_ID)
    release_id: str = Field(pattern=r"^[0-9A-Za-z_-]{1,64}$", description=(
        "the worker's name for this release, one per call: a retry with it releases nothing again"))


class TrainerHello(_Body):
    trainer_id: str = Field("trainer", pattern=ID)


class VersionUpdate(_Body):
    version: int = Field(ge=0, le=MAX_VERSION)
    recovered: bool = Field(False, description="the trainer resumed from a checkpoint at this version")
    weights: Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(_printable)] | None = Field(
        None, description="where this version's weights are: a path on the shared filesystem or an engine-specific "
                    "reference; pushed to every server worker")


# --------------------------------------------------------------------------- node agents


class GpuSampleBody(BaseModel):
    """One GPU's reading (:class:`~slurm_elastic.core.health.GpuSample`). Strict: no numbers as
    strings, no booleans as numbers, finite numbers, counts not negative, GPU indexes as
    :class:`GpuRef` bounds them; ``null`` means the agent could not read the field."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)
    node: NodeName
    index: int = Field(ge=0, le=GPU_INDEX_MAX)
    uuid: str = Field("", max_length=256)
    pci_bus_id: str | None = Field(None, max_length=256)
    temperature_c: float | None = None
    clock_event_reasons: list[Annotated[str, Field(max_length=256)]] | None = Field(None, max_length=NOTES_MAX)
    memory_used_mb: Count | None = None
    memory_total_mb: Count | None = None
    utilization_pct: float | None = Field(None, ge=0, le=100)
    power_w: float | None = Field(None, ge=0)
    ecc_uncorrectable_volatile: Count | None = None
    ecc_uncorrectable_aggregate: Count | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    lost: bool = False
    errors: list[Note] = Field(default_factory=list, max_length=NOTES_MAX)

    def to_core(self) -> GpuSample:
        fields = self.model_dump()
        reasons = self.clock_event_reasons
        return GpuSample(**{**fields, "clock_event_reasons": None if reasons is None else frozenset(reasons)})


class AgentReportBody(BaseModel):
    """What a node agent posts: ``{node, sampled_at_s, source, gpus: [...], errors}``; every
    sample names the report's node, at most :data:`NODE_GPUS_MAX` samples and :data:`NOTES_MAX`
    errors. Keys of the report besides these are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True, allow_inf_nan=False)
    node: NodeName
    sampled_at_s: float
    source: str = Field("", max_length=256)
    gpus: list[GpuSampleBody] = Field(max_length=NODE_GPUS_MAX)
    errors: list[Note] = Field(default_factory=list, max_length=NOTES_MAX)

    @model_validator(mode="after")
    def _one_node(self) -> AgentReportBody:
        for sample in self.gpus:
            if sample.node != self.node:
                raise ValueError(f"gpus: gpu {sample.index} names node {sample.node!r}, not {self.node!r}")
        return self

    def to_core(self) -> AgentReport:
        return AgentReport(self.node, self.sampled_at_s, self.source, [g.to_core() for g in self.gpus],
                           list(self.errors))


def sample_json(sample: GpuSample) -> dict[str, Any]:
    """``sample`` as the JSON its body parses (reasons sorted, so reports are stable)."""
    fields = {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}
    reasons = sample.clock_event_reasons
    return {**fields, "clock_event_reasons": None if reasons is None else sorted(reasons),
            "errors": list(sample.errors)}


def report_json(report: AgentReport) -> dict[str, Any]:
    """``report`` as the JSON :class:`AgentReportBody` parses."""
    return {"node": report.node, "sampled_at_s": report.sampled_at_s, "source": report.source,
            "gpus": [sample_json(g) for g in report.gpus], "errors": list(report.errors)}
