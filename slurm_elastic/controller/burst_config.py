"""``[burst]``: the table of burst jobs, validated so that whatever reaches the batch script is one
well-formed ``#SBATCH`` option Slurm accepts and none overrides what the controller relies on."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from slurm_elastic.core.limits import MAX_DURATION_S, MAX_TIME_LIMIT_MIN

# Options the burst script sets itself, with the key that sets them (or why they are fixed).
RESERVED_SBATCH_OPTIONS: dict[str, str] = {
    "job-name": "fixed: the controller adopts its burst jobs by name",
    "comment": "fixed: the controller adopts its burst jobs by comment",
    "signal": "set by workers.drain_signal and burst.signal_lead_s",
    "output": "fixed: the burst job's log is in the state directory",
    "nodes": "set burst.nodes_per_job",
    "gres": "set burst.gpus_per_job",
    "gpus": "set burst.gpus_per_job",
    "gpus-per-node": "set burst.gpus_per_job",
    "ntasks-per-node": "fixed: one task per node holds the GPUs",
    "cpus-per-task": "set workers.cpus_per_worker",
    "mem": "set workers.mem_per_worker_mb",
    "partition": "set burst.partition",
    "qos": "set burst.qos",
    "account": "set burst.account",
    "time": "set burst.time_limit",
}
# Options that break what a burst job is for: a job that starts when submitted and runs its script.
REFUSED_SBATCH_OPTIONS: dict[str, str] = {
    "hold": "a held burst job would never start",
    "test-only": "nothing would be submitted",
    "array": "each burst job is one job",
    "wrap": "the burst job runs its own script",
    "begin": "a burst job is asked for when it is needed, to start then",
    "dependency": "a burst job is asked for when it is needed, to start then",
}
RESERVED_SHORT_OPTIONS = {"J": "job-name", "o": "output", "N": "nodes", "G": "gpus", "c": "cpus-per-task",
                          "p": "partition", "q": "qos", "A": "account", "t": "time",
                          "H": "hold", "a": "array", "b": "begin", "d": "dependency"}
# One argument: ``--name=value`` or ``-Xvalue``; no whitespace, quotes or shell characters.
_OPTION = re.compile(r"(--(?P<long>[A-Za-z][A-Za-z0-9-]*)|-(?P<short>[A-Za-z]))(?P<rest>[^\s\"'`$;\\\x00-\x1f\x7f]*)", re.ASCII)
SLURM_NAMES = re.compile(r"[A-Za-z0-9_.,-]*", re.ASCII)  # partition, QOS and account names (lists: commas)
# Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_TIME = re.compile(r"(?:(?P<days>\d+)-(?P<hours>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                   r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)", re.ASCII)
UNLIMITED_TIMES = frozenset({"infinite", "unlimited"})
_HUGE = 10**15  # a number of 16 digits or more in a time: far past the largest, not converted whole


def time_limit_s(text: str) -> int:
    """Seconds of a Slurm time limit (``--time``); 0 for none (empty, ``0``, ``UNLIMITED``).
    Raises ValueError for a text Slurm does not read as a time, or one past the largest Slurm
    keeps (:data:`~slurm_elastic.core.limits.MAX_TIME_LIMIT_MIN`: it would wrap a larger one)."""
    seconds = _time_s(text)
    minutes = -(-seconds // 60)  # Slurm rounds seconds up to whole minutes
    if minutes > MAX_TIME_LIMIT_MIN:
        raise ValueError(f"{text[:40]!r} is {minutes if minutes < _HUGE else 'more than 10^15'} minutes, above the "
                         f"largest time limit Slurm keeps, "
                         f"{MAX_TIME_LIMIT_MIN} minutes (24855-03:13:00, 68 years): sbatch takes a larger one "
                         "but Slurm wraps it (4294967297 minutes becomes 1 minute); write UNLIMITED for no limit")
    return seconds


def _time_s(text: str) -> int:
    """Seconds of a Slurm time (0 for none); ValueError for a text Slurm does not read as one."""
    if not text or text.lower() in UNLIMITED_TIMES:
        return 0
    match = _TIME.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a Slurm time (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)")
    g = {k: int(v) if len(v.lstrip("0")) < 16 else _HUGE for k, v in match.groupdict().items() if v is not None}
    if "days" in g:
        if g["hours"] > 23 or g.get("dm", 0) > 59 or g.get("ds", 0) > 59:
            raise ValueError(f"{text!r}: hours above 23, or minutes or seconds above 59")
        return g["days"] * 86400 + g["hours"] * 3600 + g.get("dm", 0) * 60 + g.get("ds", 0)
    if "c" in g:  # H:M:S
        if g["b"] > 59 or g["c"] > 59:
            raise ValueError(f"{text!r}: minutes or seconds above 59")
        return g["a"] * 3600 + g["b"] * 60 + g["c"]
    if "b" in g:  # M:S
        if g["b"] > 59:
            raise ValueError(f"{text!r}: seconds above 59")
        return g["a"] * 60 + g["b"]
    return g["a"] * 60


def _slurm_names(value: str) -> str:
    if not SLURM_NAMES.fullmatch(value):
        raise ValueError(f"{value!r} is not a Slurm name (letters, digits, _ . - and commas)")
    return value


def _slurm_time(value: str) -> str:
    time_limit_s(value)
    return value


SlurmNames = Annotated[str, AfterValidator(_slurm_names)]  # a partition, QOS or account (lists: commas)
SlurmTime = Annotated[str, AfterValidator(_slurm_time)]  # a --time Slurm reads


def check_sbatch_option(option: str) -> None:
    """Raise ValueError unless ``option`` is one sbatch option the burst script does not set itself."""
    match = _OPTION.fullmatch(option)
    if match is None:
        raise ValueError(f"not an sbatch option: {option!r} (write each as one --name=value, without spaces, "
                         "quotes, newlines or shell characters)")
    long_name, short = match.group("long"), match.group("short")
    if long_name is not None and long_name != "exclude" and "exclude".startswith(long_name.lower()) \
            and len(long_name) >= 2:
        raise ValueError(f"{option!r}: write --exclude=NODES in full (the controller adds the nodes it keeps out)")
    if short is not None:
        if short in RESERVED_SHORT_OPTIONS:
            long_name = RESERVED_SHORT_OPTIONS[short]
        else:
            return
    name = long_name.lower()
    # sbatch takes any unambiguous prefix of a long option (--job=x is --job-name=x)
    known = {**RESERVED_SBATCH_OPTIONS, **REFUSED_SBATCH_OPTIONS}
    matched = [full for full in known if full == name or (len(name) >= 2 and full.startswith(name))]
    if matched:
        full = min(matched, key=len)
        if full in REFUSED_SBATCH_OPTIONS:
            raise ValueError(f"{option!r}: --{full} is refused in a burst job ({REFUSED_SBATCH_OPTIONS[full]})")
        raise ValueError(f"{option!r} would override --{full}, which the burst script sets itself "
                         f"({RESERVED_SBATCH_OPTIONS[full]})")


def split_excludes(options: list[str]) -> tuple[list[str], list[str]]:
    """The nodes of the ``--exclude=NODES`` and ``-xNODES`` among ``options`` (checked by
    :func:`check_sbatch_option`), and the other options: the burst script writes one ``--exclude``
    with these and the controller's (sbatch keeps only the last of several)."""
    nodes, rest = [], []
    for option in options:
        if option.startswith("--exclude="):
            nodes.append(option.removeprefix("--exclude="))
        elif option.startswith("-x"):
            nodes.append(option.removeprefix("-x").removeprefix("="))
        else:
            rest.append(option)
    return [n for n in nodes if n], rest


class BurstSection(BaseModel):
    """Burst jobs: extra Slurm jobs whose GPUs join the pool when the target exceeds the allocation
    (docs/burst.md). Off unless ``max_jobs`` > 0. Strict as the other tables: no numbers as strings,
    no booleans as numbers, finite floats."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    max_jobs: int = Field(0, ge=0, le=1000, description="Most burst jobs at once (pending ones count); 0: no burst jobs.")
    gpus_per_job: int = Field(4, ge=1, le=4096, description="GPUs of one burst job, spread evenly over its nodes.")
    nodes_per_job: int = Field(1, ge=1, le=256, description="Nodes of one burst job.")
    partition: SlurmNames = Field("", description="Partition of burst jobs (e.g. a preemptible one); empty: Slurm's default.")
    qos: SlurmNames = Field("", description="QOS of burst jobs; empty: the account's default.")
    account: SlurmNames = Field("", description="Account charged for burst jobs; empty: the user's default.")
    time_limit: SlurmTime = Field("", description="--time of a burst job, e.g. 02:00:00 (the forms and the "
                                  "largest of job.time_limit); empty: the partition's default.")
    extra_sbatch_options: list[str] = Field(default_factory=list, description="More sbatch options, each one "
                                            "argument (e.g. \"--constraint=a100\"); none of those the script sets.")
    submit_cooldown_s: float = Field(60.0, ge=0, le=MAX_DURATION_S, description="Least time between two rounds of burst submissions.")
    controller_unreachable_grace_s: float = Field(300.0, gt=0, le=MAX_DURATION_S, description="A burst job ends itself after this "
                                                  "long without an answer from the controller.")
    signal_lead_s: int = Field(120, ge=0, le=65535, description="workers.drain_signal reaches the burst job's "
                               "worker steps this long before its time limit (--signal), so they drain.")

    @field_validator("extra_sbatch_options")
    @classmethod
    def _options_are_options(cls, value: list[str]) -> list[str]:
        for option in value:
            check_sbatch_option(option)
        return value

