"""The state file's content as typed models, validated section by section and record by record.

A state file is input like any other: it may be damaged, hand-edited or written by another
version. What validates is kept; a bad worker record, cordon entry or section is dropped alone and
named in a note (the controller logs the notes and shows them in ``status``), so one bad field
never costs the operator's cordons or manual target.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from slurm_elastic.core.cordons import CordonBook
from slurm_elastic.core.lifecycle import Worker, WorkerState
from slurm_elastic.core.weights import SavedUpdates

NOTE_IDS_SHOWN = 5  # worker ids named in one note; the rest are counted
_WORKER_ID = re.compile(r"^[A-Za-z0-9_]{1,64}$")
Time = StrictFloat | None
Count = Annotated[StrictInt, Field(ge=0, le=2**31)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class WorkerRecord(_Model):
    """One worker as :meth:`Worker.to_json` writes it."""

    worker_id: Annotated[StrictStr, Field(pattern=_WORKER_ID.pattern)]
    state: WorkerState
    job_id: Annotated[StrictInt, Field(ge=0)] = 0
    step_id: Annotated[StrictStr, Field(max_length=64)] = ""
    node: Annotated[StrictStr, Field(max_length=256)] = ""
    gpus: list[Annotated[StrictInt, Field(ge=0, le=1024)]] = Field(default_factory=list, max_length=64)
    nodes: list[Annotated[StrictStr, Field(max_length=256)]] = Field(default_factory=list, max_length=1024)
    node_gpus: dict[Annotated[StrictStr, Field(max_length=256)],
                    list[Annotated[StrictInt, Field(ge=0, le=1024)]]] = Field(default_factory=dict, max_length=1024)
    launched_at_s: StrictFloat = 0.0
    last_heartbeat_s: StrictFloat = 0.0
    drain_started_s: StrictFloat = 0.0
    backoff_until_s: StrictFloat = 0.0
    crash_count: Count = 0
    launches: Count = 0
    placeholder: StrictBool = False
    busy: StrictBool = False
    rollouts: Count = 0
    busy_s: Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)] = 0.0
    paused_busy_s: Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)] = 0.0
    stood_s: Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)] = 0.0
    endpoint: Annotated[StrictStr, Field(max_length=512)] = ""
    kill_sent_s: StrictFloat = 0.0
    failure_reason: StrictStr = ""
    exit_code: StrictInt | None = None
    terminated_by_signal: StrictBool = False
    gpu_blameless: StrictBool = False
    vanished_at_s: StrictFloat = 0.0
    drain_signaled: StrictBool = False
    drained_by_its_step: StrictBool = False
    liveness_failures: Count = 0
    weights_version: Count | None = None
    suspended_from: Literal["", "STARTING", "ACTIVE", "DRAINING"] = ""
    suspended_at_s: Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)] = 0.0
    history: list[tuple[StrictFloat, StrictStr, StrictStr, StrictStr]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _suspended_knows_where_back(self) -> WorkerRecord:
        if self.state is WorkerState.SUSPENDED and not self.suspended_from:
            raise ValueError("a SUSPENDED worker needs suspended_from, the state it goes back to")
        return self

    def to_worker(self) -> Worker:
        data = self.model_dump()
        data["gpus"] = tuple(data["gpus"])
        data["nodes"] = tuple(data["nodes"])
        data["node_gpus"] = {n: tuple(g) for n, g in data["node_gpus"].items()}
        data["history"] = [tuple(h) for h in data["history"]]
        return Worker(**data)


class StallMemoryState(_Model):
    """The trainer's recurring stalls as :meth:`core.stalls.StallMemory.to_state` writes them."""

    durations_s: Annotated[list[Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)]], Field(max_length=100)] = Field(
        default_factory=list)
    since_s: Time = None
    restored: StrictBool = False


class AutoscalerMemory(_Model):
    """The autoscaler's memory as :meth:`Autoscaler.to_state` writes it."""

    integral: StrictFloat = 0.0
    last_queued: StrictFloat | None = None
    votes_dir: Annotated[StrictInt, Field(ge=-1, le=1)] = 0
    votes: Count = 0
    direction_since_s: Time = None
    last_up_s: Time = None
    last_down_s: Time = None
    # (time, recommendation, the trainer's demand then); the 2-item form was written before the demand
    window: list[tuple[StrictFloat, StrictFloat, StrictFloat | None] | tuple[StrictFloat, StrictFloat]] = Field(
        default_factory=list)
    held_dir: Annotated[StrictInt, Field(ge=-1, le=1)] = 0
    ramped: StrictBool = True
    starting: StrictBool = False
    # (workers, the trainer's demand, when) at its normal pace, as core.speedup.UsualCount keeps them
    usual: tuple[Annotated[StrictFloat, Field(ge=0, le=100_000, allow_inf_nan=False)],
                 Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)],
                 Annotated[StrictFloat, Field(allow_inf_nan=False)]] | None = None
    stalls: StallMemoryState | None = None
    # when the last scale-downs were undone by a starving trainer, as core.swings.SwingMemory keeps them
    swings: Annotated[list[Annotated[StrictFloat, Field(allow_inf_nan=False)]], Field(max_length=100)] = Field(
        default_factory=list)
    lead_s: Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)] | None = None  # launch to first rollout
    first_seen_s: Annotated[StrictFloat, Field(allow_inf_nan=False)] | None = None  # the start-up's first decision


class WeightsUpdatesRecord(_Model):
    """One server's weight updates as :meth:`WeightsBook.saved_updates` keeps them."""

    failures: Annotated[StrictInt, Field(ge=0, le=1000)] = 0
    in_flight: Count | None = None
    on_fallback: StrictBool = False
    sent_at_s: Annotated[StrictFloat, Field(allow_inf_nan=False)] = 0.0
    retry_at_s: Annotated[StrictFloat, Field(allow_inf_nan=False)] = 0.0
    last_error: Annotated[StrictStr, Field(max_length=4096)] = ""


JobIds = Annotated[list[Annotated[StrictInt, Field(ge=1)]], Field(max_length=10_000)]
NonNegative = Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)]


class BurstMemory(_Model):
    """What the burst manager keeps across restarts, as :meth:`BurstManager.to_state` writes it."""

    submitted: Count = 0
    cancelled: Count = 0
    lost: Count = 0
    requeued: Count = 0
    gpu_s_held: NonNegative = 0.0
    gpu_s_used: NonNegative = 0.0
    given_back: JobIds = Field(default_factory=list)  # jobs this job cancelled or released: not lost when they end
    ending: JobIds = Field(default_factory=list)  # jobs Slurm is ending (preemption, time limit), released for good
    signalled: JobIds = Field(default_factory=list)  # of those, the ones Slurm signalled: lost unless requeued
    running: JobIds = Field(default_factory=list)  # runs not over at the last listing: lost if they end unreleased
    pending: JobIds = Field(default_factory=list)  # jobs pending at the last listing: lost if they end unreleased
    last_submit_s: Annotated[StrictFloat, Field(allow_inf_nan=False)] | None = None
    suspended_since: Annotated[list[tuple[Annotated[StrictInt, Field(ge=0)],
                                          Annotated[StrictFloat, Field(allow_inf_nan=False)]]],
                               Field(max_length=10_000)] = Field(default_factory=list)  # jobs listed suspended: since


class LeftNode(_Model):
    """A node Slurm took out of the running job, as status shows it."""

    node: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    gpus: Count
    at_s: StrictFloat


Workers = Annotated[StrictInt, Field(ge=0, le=100_000)]
SCALARS: dict[str, TypeAdapter[Any]] = {  # the state's single values, each validated on its own
    "next_number": TypeAdapter(Annotated[StrictInt, Field(ge=1, le=2**31)]),
    "target_workers": TypeAdapter(Workers),
    "manual_target": TypeAdapter(Workers | None),
    "paused": TypeAdapter(StrictBool),
    "wake_all_active": TypeAdapter(StrictBool),
    "left_nodes": TypeAdapter(Annotated[list[LeftNode], Field(max_length=10_000)]),
    "weights_joined": TypeAdapter(Annotated[list[Annotated[StrictStr, Field(pattern=_WORKER_ID.pattern)]],
                                            Field(max_length=100_000)]),
    "weights_updates": TypeAdapter(Annotated[dict[Annotated[StrictStr, Field(pattern=_WORKER_ID.pattern)],
                                                  WeightsUpdatesRecord], Field(max_length=100_000)]),
}


@dataclass(frozen=True)
class RestoredState:
    """What a state file gave back: typed, with a note for everything it could not."""

    workers: dict[str, Worker] = field(default_factory=dict)
    next_number: int | None = None
    target_workers: int | None = None
    manual_target: int | None = None
    paused: bool = False
    wake_all_active: bool = False
    left_nodes: tuple[dict[str, Any], ...] = ()
    weights_joined: tuple[str, ...] = ()  # server workers in discovery by the weights book's rules
    weights_updates: dict[str, SavedUpdates] = field(default_factory=dict)  # failures in a row, updates in flight
    autoscaler: dict[str, Any] | None = None
    cordons: dict[str, Any] | None = None
    burst: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()
    found: bool = False  # a state file of this job was read (else the first listing seeds the target)
    dropped: bool = False  # something in the file was not kept


def restore_state(body: dict[str, Any]) -> RestoredState:
    """Validate the ``state`` object of a state file; what fails is left out and noted."""
    notes: list[str] = []
    workers = _workers(body.get("workers", {}), notes)
    values: dict[str, Any] = {}
    for name, adapter in SCALARS.items():
        if name not in body:
            continue
        try:
            values[name] = adapter.validate_python(body[name])
        except ValidationError as exc:
            notes.append(f"{name} {_shown(body[name])} is not valid ({_first_error(exc)}): not restored")
    if "weights_updates" in values:
        values["weights_updates"] = {w: SavedUpdates(**r.model_dump()) for w, r in values["weights_updates"].items()}
    if "weights_joined" in values:
        values["weights_joined"] = tuple(values["weights_joined"])
    if "left_nodes" in values:
        values["left_nodes"] = tuple(left.model_dump() for left in values["left_nodes"])
    if "next_number" not in values and workers:
        values["next_number"] = 1 + max((int(k) for k in workers if k.isdigit()), default=0)
    autoscaler = _memory(body, "autoscaler", AutoscalerMemory, notes, "starting fresh")
    cordons = _cordons(body["cordons"], notes) if "cordons" in body else None
    burst = _memory(body, "burst", BurstMemory, notes, "its counters start from 0")
    return RestoredState(workers=workers, autoscaler=autoscaler, cordons=cordons, burst=burst, notes=tuple(notes),
                         dropped=bool(notes), **values)


def _memory(body: dict[str, Any], key: str, model: type[_Model], notes: list[str], otherwise: str
            ) -> dict[str, Any] | None:
    """The section ``key`` validated by ``model``; None (and a note saying ``otherwise``) if it is not valid."""
    if key not in body:
        return None
    try:
        return model.model_validate(body[key]).model_dump()
    except ValidationError as exc:
        notes.append(f"{key} memory is not valid ({_first_error(exc)}): {otherwise}")
        return None


def _workers(raw: Any, notes: list[str]) -> dict[str, Worker]:
    if not isinstance(raw, dict):
        notes.append(f"workers is not an object ({type(raw).__name__}): no worker record restored "
                     "(running steps are adopted from Slurm's listing)")
        return {}
    kept: dict[str, Worker] = {}
    bad: list[str] = []
    why = ""
    for key, value in raw.items():
        try:
            record = WorkerRecord.model_validate(value)
            if record.worker_id != key:
                raise ValueError(f"record of {record.worker_id!r} filed under {key!r}")
            kept[key] = record.to_worker()
        except (ValidationError, ValueError) as exc:
            bad.append(str(key))
            why = why or (_first_error(exc) if isinstance(exc, ValidationError) else str(exc))
    if bad:
        notes.append(f"dropped {len(bad)} unreadable worker record(s): {_named(bad)} (first: {why}); "
                     "their steps, if running, are adopted from Slurm's listing")
    return kept


def _cordons(raw: Any, notes: list[str]) -> dict[str, Any] | None:
    """The cordon book's state with every GPU entry that the book itself accepts."""
    version = raw.get("version") if isinstance(raw, dict) else None
    if version != CordonBook.STATE_VERSION:
        notes.append(f"cordons: unknown format (version {_shown(version)}): no cordon restored")
        return None
    heard = raw.get("heard_s", {})
    if not (isinstance(heard, dict) and all(isinstance(v, int | float) and not isinstance(v, bool)
                                            for v in heard.values())):
        notes.append("cordons: agents' last-heard times unreadable: not restored")
        heard = {}
    items = raw.get("gpus", [])
    items = items if isinstance(items, list) else [items]
    kept, bad = [], []
    why = ""
    for item in items:
        try:
            CordonBook.from_state({"version": version, "heard_s": {}, "gpus": [item]})
            kept.append(item)
        except (ValueError, TypeError) as exc:
            bad.append(f"{item.get('node')}:{item.get('gpu')}" if isinstance(item, dict) else _shown(item))
            why = why or str(exc)
    if bad:
        notes.append(f"cordons: dropped {len(bad)} unreadable GPU entr{'y' if len(bad) == 1 else 'ies'}: "
                     f"{_named(bad)} (first: {why})")
    return {"version": version, "heard_s": heard, "gpus": kept}


def _named(items: list[str]) -> str:
    shown = ", ".join(_shown(i) for i in items[:NOTE_IDS_SHOWN])
    return shown + (f" and {len(items) - NOTE_IDS_SHOWN} more" if len(items) > NOTE_IDS_SHOWN else "")


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")  # pydantic's prefix
    return f"{loc}: {msg}" if loc else msg


def _shown(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
