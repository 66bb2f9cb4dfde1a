"""One job as ``scontrol show job -d ID`` prints it: its GPUs per node and, where ``squeue --json``
is not there (a Slurm built without JSON support says "could not find plugin for
application/json"; Slurm before 21.08 has no ``--json``), its :class:`JobInfo`.

The multi-line form is read, not ``--oneliner``: a job's name shares the first line with its id,
and fields whose values may hold spaces (``Comment``, ``WorkDir``, ``Command``, ...) have a line
each, so both are taken whole; every other field is a ``Key=value`` token without spaces.
"""

from __future__ import annotations

import time

from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.parse import (
    JobInfo,
    ended_exit_code,
    expand_hostlist,
    parse_gres_indexes,
    slurm_reason,
)

WHOLE_LINE_FIELDS = ("Comment", "AdminComment", "SystemComment", "WorkDir", "Command", "StdErr", "StdIn", "StdOut",
                     "Power")


def parse_scontrol_job_gpus(text: str) -> dict[str, tuple[int, ...]]:
    """Node -> the job's GPU indexes there, from its detail lines ``Nodes=node[1-2] CPU_IDs=0-3
    Mem=400 GRES=gpu:2(IDX:0-1)`` (one per group of nodes with the same layout). A job without
    nodes yet (pending) gives ``{}``; a node without GPUs ``()``."""
    gpus: dict[str, tuple[int, ...]] = {}
    for line in text.splitlines():
        fields = dict(token.partition("=")[::2] for token in line.split())
        if "Nodes" not in fields or "CPU_IDs" not in fields:
            continue
        indexes = parse_gres_indexes(fields.get("GRES", ""))
        for node in expand_hostlist(fields["Nodes"]):
            gpus[node] = indexes
    return gpus


def scontrol_job_fields(text: str) -> dict[str, str]:
    """The job's fields (the first job in ``text``): name -> value as printed."""
    lines = [line.strip() for line in text.splitlines()]
    if not lines or not lines[0].startswith("JobId="):
        raise SlurmError(f"unexpected scontrol show job output: {text[:200]!r}")
    head, _, name = lines[0].partition(" JobName=")  # an array job's head: JobId=5 ArrayJobId=5 ArrayTaskId=1
    fields = dict(token.partition("=")[::2] for token in head.split())
    fields["JobName"] = name
    for line in lines[1:]:
        if line.startswith("JobId="):  # the next job (an array or het job's other parts)
            break
        key = line.partition("=")[0]
        if key in WHOLE_LINE_FIELDS:
            fields[key] = line.partition("=")[2]
        elif not line.startswith("Nodes="):  # a GPU detail line: parse_scontrol_job_gpus reads those
            fields.update(token.partition("=")[::2] for token in line.split() if "=" in token)
    return fields


def job_info_from_scontrol(text: str) -> JobInfo:
    """A JobInfo from ``scontrol show job -d ID``. Slurm prints no cluster name there (it is ``""``:
    the controller takes SLURM_CLUSTER_NAME); the submit time is read in the local time zone, as
    scontrol writes it."""
    fields = scontrol_job_fields(text)
    try:
        job_id = int(fields["JobId"])
    except ValueError:
        raise SlurmError(f"unexpected job id {fields['JobId']!r} in scontrol show job output") from None
    nodes = fields.get("NodeList", "")
    restarts = fields.get("Restarts", "0")
    return JobInfo(
        job_id=job_id, name=fields["JobName"], state=fields.get("JobState", ""),
        nodes=() if nodes in ("", "(null)") else tuple(expand_hostlist(nodes)),
        batch_host="" if fields.get("BatchHost", "(null)") == "(null)" else fields["BatchHost"],
        comment="" if fields.get("Comment", "(null)") == "(null)" else fields["Comment"],
        user_name=fields.get("UserId", "").partition("(")[0], partition=fields.get("Partition", ""),
        gpus_by_node=parse_scontrol_job_gpus(text), submit_time_s=_epoch_s(fields.get("SubmitTime", "")),
        restart_count=int(restarts) if restarts.isdigit() else 0,
        start_time_s=_epoch_s(fields.get("StartTime", "")), end_time_s=_epoch_s(fields.get("EndTime", "")),
        exit_code=ended_exit_code(fields.get("JobState", ""), _exit_code(fields.get("ExitCode", ""))),
        output=fields.get("StdOut", ""), reason=slurm_reason(fields.get("Reason", "")),
    )


def _exit_code(text: str) -> int | None:
    """``ExitCode=78:0`` (code:signal) as 78; None where a signal ended it, or none is given."""
    code, _, signal = text.partition(":")
    return int(code) if code.isdigit() and signal in ("", "0") else None


def _epoch_s(when: str) -> int:
    """``2026-11-27T19:28:41`` (scontrol's local time) as epoch seconds; 0 for ``Unknown`` or anything else."""
    try:
        return int(time.mktime(time.strptime(when, "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return 0
