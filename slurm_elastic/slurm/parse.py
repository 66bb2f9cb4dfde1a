"""Pure parsers of Slurm output: hostlists, step listings, job JSON, node states, sdiag.

Tested on recorded output (tests/unit/data/) and on live output from the dev cluster.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from slurm_elastic.errors import SlurmError, SlurmUnavailableError

# squeue --steps --format: fields joined by the ASCII unit separator, the free-text name last.
FIELD_SEP = "\x1f"
STEP_FORMAT = FIELD_SEP.join(["%i", "%N", "%M", "%S", "%b", "%A", "%j"])


@dataclass(frozen=True)
class StepInfo:
    """One running job step as Slurm reports it."""

    job_id: int
    step_id: str  # "0", "1", ... or "batch", "extern", "interactive"
    name: str
    nodes: tuple[str, ...]
    time_used: str
    start_time: str
    tres_per_node: str
    num_tasks: int

    @property
    def step_ref(self) -> str:
        """``JOBID.STEPID`` as scancel takes it."""
        return f"{self.job_id}.{self.step_id}"


# squeue --format for a job listing: id, state, nodes, GPUs per node, pending reason, (expected)
# start, node count, partition, name, command (a batch job's script path); the free-text comment last.
JOB_FORMAT = FIELD_SEP.join(["%i", "%T", "%N", "%b", "%r", "%S", "%D", "%P", "%j", "%o", "%k"])
_GPU_COUNT = re.compile(r"gpu(?::[^:,]+)?:(\d+)")


@dataclass(frozen=True)
class QueuedJob:
    """One job as ``squeue --format=JOB_FORMAT`` lists it (pending, running or completing)."""

    job_id: int
    state: str
    nodes: tuple[str, ...]
    gpus_per_node: int
    reason: str  # why a pending job waits ("Resources", "Priority", ...); "" when none
    start_time: str  # a running job's start, a pending job's expected start (ISO, local time); "" if none
    node_count: int
    partition: str
    name: str
    comment: str
    command: str = ""  # a batch job's script path as submitted ("" for --wrap); no one can change it


def parse_job_lines(text: str) -> list[QueuedJob]:
    """Parse ``squeue --noheader --format=JOB_FORMAT`` output."""
    jobs: list[QueuedJob] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split(FIELD_SEP, 10)
        if len(fields) != 11:
            raise SlurmError(f"unexpected squeue job line: {line!r}")
        job_id, state, nodes, tres, reason, start, count, partition, name, command, comment = (
            f.strip() for f in fields)
        if not job_id.isdigit():
            raise SlurmError(f"unexpected job id {job_id!r} in squeue output")
        gpus = _GPU_COUNT.search(tres)
        jobs.append(QueuedJob(
            job_id=int(job_id), state=state, nodes=tuple(expand_hostlist(nodes)),
            gpus_per_node=int(gpus.group(1)) if gpus else 0,
            reason="" if reason in ("None", "(null)") else reason,
            start_time="" if start in ("N/A", "Unknown", "NONE", "(null)") else start,
            node_count=int(count) if count.isdigit() else 0, partition=partition, name=name,
            comment="" if comment == "(null)" else comment, command="" if command == "(null)" else command,
        ))
    return jobs


@dataclass(frozen=True)
class JobInfo:
    """The fields of a job that slurm-elastic uses."""

    job_id: int
    name: str
    state: str
    nodes: tuple[str, ...]
    batch_host: str
    comment: str
    user_name: str
    partition: str
    gpus_by_node: dict[str, tuple[int, ...]] = field(default_factory=dict)
    cluster: str = ""  # the cluster's name (ClusterName)
    submit_time_s: int = 0  # when Slurm took the job (epoch s; a requeue sets it anew); 0 if unknown
    restart_count: int = 0  # how often Slurm requeued the job
    start_time_s: int = 0  # when the job (its current run) started (epoch s); 0 if unknown
    end_time_s: int = 0  # its time limit, as a time (epoch s; moves when the limit is changed); 0 if unknown
    exit_code: int | None = None  # the batch script's exit code once it ended (None: not ended, or killed by a signal)
    output: str = ""  # the batch script's output file, %j filled in ("" if unknown)
    reason: str = ""  # Slurm's reason for the job's state (JobHeldUser, Resources, TimeLimit, ...); "" when none
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_running(self) -> bool:
        return self.state == "RUNNING"


# Slurm job states in which the batch script has ended (COMPLETING: its steps are being cleaned up)
ENDED_STATES = frozenset({"COMPLETING", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                          "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"})


def ended_exit_code(state: str, code: int | None) -> int | None:
    """``code`` for a job in one of the ENDED_STATES; None for any other: Slurm 22.05 reports 0
    for a job that is pending, running or suspended."""
    return code if state in ENDED_STATES else None


def output_file(output: str, job_id: int, work_dir: str = "") -> str:
    """The batch script's output file: ``output`` with ``%j`` filled in; where none was given,
    Slurm's default ``WORK_DIR/slurm-<job id>.out`` ("" without a ``work_dir``): ``squeue
    --json`` leaves a job's output empty when it names none (``scontrol show job`` fills it in)."""
    if output:
        return output.replace("%j", str(job_id))
    return str(PurePosixPath(work_dir) / f"slurm-{job_id}.out") if work_dir else ""


def slurm_reason(reason: Any) -> str:
    """Slurm's reason for a job's state; "" for its ``None`` (no reason)."""
    text = str(reason or "")
    return "" if text in ("None", "(null)") else text


def _exit_code(value: Any) -> int | None:
    """``squeue --json``'s exit code: a wait status (22.05: 19968 is exit 78) or, from 23.02, an
    object with ``status`` and ``return_code``; None for a job killed by a signal, or none yet."""
    if isinstance(value, dict):
        code, status = value.get("return_code"), value.get("status")
        code = code.get("number") if isinstance(code, dict) else code
        exited = {"EXITED", "SUCCESS"} & set(status if isinstance(status, list) else [status])
        return code if isinstance(code, int) and exited else None
    if isinstance(value, int) and value & 0x7F == 0:
        return value >> 8
    return None


_BRACKET = re.compile(r"\[([^\]]*)\]")


# sinfo --Format for node states: name and complete state, each ended by the unit separator; the
# free-text reason last (sinfo -O pads nothing and cuts nothing where a field has a suffix).
NODE_FORMAT = f"NodeList:{FIELD_SEP},StateComplete:{FIELD_SEP},Reason:"


@dataclass(frozen=True)
class NodeState:
    """One node as Slurm reports it: its complete state (``mixed+drain``, lower case) and the reason
    an admin gave ("" when none)."""

    name: str
    state: str
    reason: str = ""


def parse_node_lines(text: str) -> dict[str, NodeState]:
    """``sinfo --Node --noheader --Format=NODE_FORMAT`` output -> node -> state (a node is listed
    once per partition; the lines agree)."""
    nodes: dict[str, NodeState] = {}
    for line in text.splitlines():
        parts = line.split(FIELD_SEP, 2)
        if len(parts) != 3 or not parts[0].strip():
            continue
        reason = parts[2].strip()
        nodes[parts[0].strip()] = NodeState(parts[0].strip(), parts[1].strip().lower(),
                                            "" if reason.lower() == "none" else reason)
    return nodes


def maintenance_reasons(text: str, nodes: Sequence[str]) -> dict[str, str]:
    """``scontrol show reservation --oneliner`` output -> the reason each of ``nodes`` that an
    active maintenance reservation (Flags=MAINT) holds is out of use, naming it and its end."""
    reasons: dict[str, str] = {}
    wanted = set(nodes)
    for line in text.splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if fields.get("State") != "ACTIVE" or "MAINT" not in fields.get("Flags", "").split(","):
            continue
        try:
            held = expand_hostlist(fields.get("Nodes", ""))
        except SlurmError:
            continue
        for node in wanted.intersection(held):
            reasons.setdefault(node, f"maintenance reservation {fields.get('ReservationName', '?')} "
                                     f"until {fields.get('EndTime', '?')}")
    return reasons


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist (``node[1-3,5]``, ``gpu[01-02]-ib``, ``a,b[1-2]``) into names, in order.

    Zero padding is kept (``n[08-10]`` gives n08, n09, n10). Several bracket groups in one name
    expand as a product, as Slurm does. Raises SlurmError on malformed input.
    """
    expr = expr.strip()
    if not expr or expr == "(null)":
        return []
    names: list[str] = []
    for part in _split_top_level(expr):
        names.extend(_expand_one(part))
    return names


def _split_top_level(expr: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in expr:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"malformed hostlist {expr!r}: unbalanced ']'")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise SlurmError(f"malformed hostlist {expr!r}: unbalanced '['")
    parts.append("".join(current))
    return [p for p in (p.strip() for p in parts) if p]


def _expand_one(name: str) -> list[str]:
    match = _BRACKET.search(name)
    if match is None:
        if "[" in name or "]" in name:
            raise SlurmError(f"malformed hostlist entry {name!r}")
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    out: list[str] = []
    for token in match.group(1).split(","):
        token = token.strip()
        if not token:
            raise SlurmError(f"malformed hostlist entry {name!r}: empty range")
        lo, sep, hi = token.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise SlurmError(f"malformed hostlist entry {name!r}: bad range {token!r}")
        width = len(lo) if lo.startswith("0") or (sep and len(lo) == len(hi)) else 0
        start, stop = int(lo), int(hi) if sep else int(lo)
        if stop < start:
            raise SlurmError(f"malformed hostlist entry {name!r}: range {token!r} runs backwards")
        for number in range(start, stop + 1):
            for rest in _expand_one(tail):
                out.append(f"{head}{number:0{width}d}{rest}")
    return out


def parse_step_lines(text: str) -> list[StepInfo]:
    """Parse ``squeue --steps --noheader --format=STEP_FORMAT`` output."""
    steps: list[StepInfo] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split(FIELD_SEP, 6)
        if len(fields) != 7:
            raise SlurmError(f"unexpected squeue step line: {line!r}")
        step_ref, nodes, time_used, start, tres, tasks, name = fields
        job_part, _, step_id = step_ref.strip().partition(".")
        if not job_part.isdigit() or not step_id:
            raise SlurmError(f"unexpected step id {step_ref!r} in squeue output")
        steps.append(
            StepInfo(
                job_id=int(job_part),
                step_id=step_id,
                name=name.rstrip("\n"),
                nodes=tuple(expand_hostlist(nodes)),
                time_used=time_used.strip(),
                start_time=start.strip(),
                tres_per_node="" if tres.strip() == "(null)" else tres.strip(),
                num_tasks=int(tasks) if tasks.strip().isdigit() else 0,
            )
        )
    return steps


def parse_jobs_json(text: str) -> list[JobInfo]:
    """Parse ``squeue --json`` output (the ``jobs`` array; Slurm 22.05 and later)."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SlurmError(f"squeue --json printed invalid JSON: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("jobs"), list):
        raise SlurmError("squeue --json output has no 'jobs' list")
    errors = [e for e in document.get("errors") or [] if isinstance(e, dict)]
    if errors and not document["jobs"]:  # exit 0 with an error list: slurmctld did not answer
        detail = "; ".join(str(e.get("description") or e.get("error") or e) for e in errors)
        raise SlurmUnavailableError(f"squeue --json: Slurm reported an error instead of jobs: {detail}")
    jobs = []
    for raw in document["jobs"]:
        state = raw.get("job_state", "")
        if isinstance(state, list):  # Slurm >= 23.02 reports a list of flags
            state = state[0] if state else ""
        # an array task's default output is slurm-<array job>_<task>.out: not filled in
        work_dir = "" if _int(raw.get("array_job_id")) else str(raw.get("current_working_directory") or "")
        jobs.append(
            JobInfo(
                job_id=int(raw["job_id"]),
                name=str(raw.get("name", "")),
                state=str(state),
                nodes=tuple(expand_hostlist(str(raw.get("nodes", "")))),
                batch_host=str(raw.get("batch_host", "")),
                comment=str(raw.get("comment", "")),
                user_name=str(raw.get("user_name", "")),
                partition=str(raw.get("partition", "")),
                gpus_by_node=_gpus_by_node(raw),
                cluster=str(raw.get("cluster", "")),
                submit_time_s=_int(raw.get("submit_time")),
                restart_count=_int(raw.get("restart_cnt")),
                start_time_s=_int(raw.get("start_time")),
                end_time_s=0 if _unlimited(raw.get("time_limit")) else _int(raw.get("end_time")),
                exit_code=ended_exit_code(str(state), _exit_code(raw.get("exit_code"))),
                output=output_file(str(raw.get("standard_output") or ""), int(raw["job_id"]), work_dir),
                reason=slurm_reason(raw.get("state_reason")),
                raw=raw,
            )
        )
    return jobs


def _unlimited(time_limit: Any) -> bool:
    """A job's ``time_limit`` in Slurm's JSON says none (22.05: null; later: ``{"infinite": true}``):
    its ``end_time`` is then a year after its start, not a limit (``scontrol`` says ``Unknown``)."""
    return time_limit is None or (isinstance(time_limit, dict) and bool(time_limit.get("infinite")))


def _int(value: Any) -> int:
    """An integer field of Slurm's JSON (22.05: a number; later: ``{"set": .., "number": ..}``); 0 if absent."""
    if isinstance(value, dict):
        value = value.get("number", 0) if value.get("set", True) else 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


_GRES_IDX = re.compile(r"gpu(?::[^:(]+)?:(\d+)\(IDX:([^)]*)\)")


def parse_gres_indexes(detail: str) -> tuple[int, ...]:
    """GPU indexes from one ``gres_detail`` entry: ``gpu:4(IDX:0-3)``, ``gpu:a100:2(IDX:0,2)``."""
    indexes: list[int] = []
    for match in _GRES_IDX.finditer(detail):
        for part in match.group(2).split(","):
            lo, _, hi = part.partition("-")
            if lo.strip().isdigit():
                indexes.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(set(indexes)))


def _gpus_by_node(raw: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Node -> the job's GPU indexes there (``gres_detail`` lists one entry per node, in node order)."""
    nodes = expand_hostlist(str(raw.get("nodes", "")))
    details = raw.get("gres_detail") or []
    if not isinstance(details, list) or len(details) != len(nodes):
        return {}
    return {node: parse_gres_indexes(str(detail)) for node, detail in zip(nodes, details, strict=True)}


def slurm_version_of_json(text: str) -> tuple[int, int] | None:
    """(major, minor) from the ``meta`` block of any Slurm ``--json`` output, if present."""
    try:
        version = json.loads(text)["meta"]["Slurm"]["version"]
        return int(version["major"]), int(version["minor"])
    except (ValueError, KeyError, TypeError):
        return None


def parse_sdiag_rpc_counts(text: str) -> dict[str, int]:
    """RPC counts by message type from ``sdiag`` ("Remote Procedure Call statistics by message type")."""
    counts: dict[str, int] = {}
    in_section = False
    for line in text.splitlines():
        if line.startswith("Remote Procedure Call statistics by message type"):
            in_section = True
            continue
        if in_section:
            if not line.strip() or line.startswith("Remote Procedure Call statistics by user"):
                if counts:
                    break
                continue
            match = re.match(r"\s*(\S+)\s+\(\s*\d+\)\s+count:(\d+)", line)
            if match:
                counts[match.group(1)] = int(match.group(2))
    return counts
