"""``elastic.toml``: the controller's configuration, validated, with units in every key name.

Unknown keys and bad values are errors that name the key (``workers.gpus_per_worker: ...``).
The keys of each table are in :mod:`slurm_elastic.controller.config_sections` (``[burst]``'s in
:mod:`slurm_elastic.controller.burst_config`), where ``[health]`` becomes the core's
:class:`~slurm_elastic.core.health.HealthRules`; here the whole file and the checks across its
tables. The ``[autoscaler]`` and ``[queue]`` tables are validated by their own modules, at load
time too, so a bad value is refused before anything touches Slurm.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin

import annotated_types as at
from pydantic import Field, ValidationError, model_validator

from slurm_elastic.controller.burst_config import BurstSection, time_limit_s
from slurm_elastic.controller.config_sections import (
    AgentSection,
    ControllerSection,
    HealthSection,
    JobSection,
    StrictSection,
    WeightsSection,
    WorkersSection,
)
from slurm_elastic.core.limits import shown
from slurm_elastic.errors import ConfigError, unknown_key

if TYPE_CHECKING:
    from slurm_elastic.core.autoscaler_config import AutoscalerConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


log = logging.getLogger(__name__)

# [workers] keys only servers read (probes, the drain grace)
SERVER_KEYS = frozenset({"readiness_path", "liveness_path", "liveness_interval_s", "liveness_timeout_s",
                         "liveness_failure_threshold", "server_drain_grace_s"})


class ElasticConfig(StrictSection):
    """The whole file."""

    controller: ControllerSection = ControllerSection()
    workers: WorkersSection = WorkersSection()
    agent: AgentSection = AgentSection()
    weights: WeightsSection = WeightsSection()
    job: JobSection = JobSection()
    autoscaler: dict[str, Any] = Field(default_factory=dict)
    queue: dict[str, Any] = Field(default_factory=dict)
    health: HealthSection = HealthSection()
    burst: BurstSection = BurstSection()

    @model_validator(mode="after")
    def _tables_agree(self) -> ElasticConfig:
        job = self.job
        if job.mem_per_node_mb and not (job.trainer_mem_mb and self.workers.mem_per_worker_mb):
            missing = " and ".join(name for name, value in (("job.trainer_mem_mb", job.trainer_mem_mb),
                                                              ("workers.mem_per_worker_mb", self.workers.mem_per_worker_mb))
                                   if not value)
            raise ValueError(f"job.mem_per_node_mb ({job.mem_per_node_mb}) needs {missing} too: in a job that sets --mem, a step without --mem takes "
                             "the job's whole memory on its node, and no worker could start beside it")
        if self.agent.enabled and self.agent.interval_s >= self.health.agent_silence_s:
            raise ValueError(f"agent.interval_s ({self.agent.interval_s:g}) must be below health.agent_silence_s "
                             f"({self.health.agent_silence_s:g}): every node would read as of unknown health between "
                             "two samples")
        return self

    @model_validator(mode="after")
    def _no_key_left_unread(self) -> ElasticConfig:
        """A server's key with rollout workers (most likely ``workers.kind`` forgotten) is refused, naming
        both; the agents' settings beside ``agent.enabled = false`` are only logged (a switch turned off)."""
        if self.workers.kind != "server":  # a default written out (update = "none") changes nothing: let be
            workers, weights = type(self.workers)(), type(self.weights)()
            unread = sorted(key for key in SERVER_KEYS & self.workers.model_fields_set
                            if getattr(self.workers, key) != getattr(workers, key))
            unread += [f"weights.{key}" for key in sorted(self.weights.model_fields_set)
                       if getattr(self.weights, key) != getattr(weights, key)]
            if unread:
                first = unread[0] if "." in unread[0] else f"workers.{unread[0]}"
                raise ValueError(f"{first} is read only for servers, and workers.kind is {self.workers.kind!r}: set "
                                 "workers.kind = 'server', or remove it")
        if not self.agent.enabled and (unread := sorted(self.agent.model_fields_set - {"enabled"})):
            # a switch turned off, its settings kept for when it is turned on again: said, not refused
            log.warning("agent.%s %s read only by the agents, and agent.enabled is false: unused until they are "
                        "turned on", ", agent.".join(unread), "is" if len(unread) == 1 else "are")
        return self

    @model_validator(mode="after")
    def _burst_jobs_fit_workers(self) -> ElasticConfig:
        burst, per_worker = self.burst, self.workers.gpus_per_worker
        if burst.gpus_per_job % burst.nodes_per_job:
            raise ValueError(f"burst.gpus_per_job ({burst.gpus_per_job}) must split evenly over "
                             f"burst.nodes_per_job ({burst.nodes_per_job})")
        if burst.max_jobs and not per_worker:
            raise ValueError("burst.max_jobs: burst jobs lend GPUs, but workers.gpus_per_worker is 0")
        gpus_per_node = burst.gpus_per_job // burst.nodes_per_job
        if burst.max_jobs and gpus_per_node % per_worker:
            raise ValueError(f"burst.gpus_per_job: {gpus_per_node} GPUs per node of a burst job do not "
                             f"hold whole workers of workers.gpus_per_worker = {per_worker}")
        limit_s = time_limit_s(burst.time_limit)
        if burst.max_jobs and limit_s and limit_s <= burst.signal_lead_s:
            raise ValueError(f"burst.time_limit ({burst.time_limit} = {limit_s} s) must be longer than "
                             f"burst.signal_lead_s ({burst.signal_lead_s} s): the drain signal would come at once")
        per_unit = [o for o in burst.extra_sbatch_options if o.lower().startswith(("--mem-per-cpu", "--mem-per-gpu"))]
        if self.workers.mem_per_worker_mb and per_unit:
            raise ValueError(f"burst.extra_sbatch_options: {per_unit[0]!r} and workers.mem_per_worker_mb "
                             f"({self.workers.mem_per_worker_mb}, which the burst script sets as --mem) exclude each "
                             "other in Slurm: set one of them")
        return self


# keys that belong to another table: refused with the key that does the job
MOVED_KEYS: dict[tuple[str, str], str] = {
    ("workers", "requests_per_worker_capacity"): "autoscaler.requests_per_worker_capacity",
}


def parse_config(data: dict[str, Any], source: str = "config") -> ElasticConfig:
    """Validate a parsed TOML document; errors name the key."""
    for (section, key), instead in MOVED_KEYS.items():
        table = data.get(section)
        if isinstance(table, dict) and key in table:
            raise ConfigError(f"{source}: {section}.{key}: not a [{section}] key; set {instead}")
    try:
        config = ElasticConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            key = ".".join(str(p) for p in error["loc"])
            problem = (_unknown(error["loc"]) if error["type"] == "extra_forbidden"
                       else error["msg"].removeprefix("Value error, "))
            problems.append(f"{key}: {problem}" if key else problem)
        raise ConfigError(f"{source}: " + "; ".join(problems)) from None
    _validate_policy_tables(config, source)
    _validate_worker_shape(config, source)
    return config


def _unknown(loc: tuple[int | str, ...]) -> str:
    """"unknown key" for the key at ``loc``, naming a close key of its table (a typo)."""
    model: Any = ElasticConfig
    for part in loc[:-1]:
        model = model.model_fields[str(part)].annotation if part in getattr(model, "model_fields", {}) else None
    return unknown_key(str(loc[-1]), getattr(model, "model_fields", {}))


def _validate_worker_shape(config: ElasticConfig, source: str) -> None:
    """``gpus_per_worker`` over whole nodes, against the GPUs per node the file states (the
    controller checks the real allocation again at start)."""
    from slurm_elastic.core.shape import worker_shape

    w, job = config.workers, config.job
    node_gpus = config.controller.gpus_per_node or (job.gpus_per_node if "gpus_per_node" in job.model_fields_set else 0)
    where = ("controller.gpus_per_node" if config.controller.gpus_per_node else "job.gpus_per_node") + f" = {node_gpus}"
    try:
        worker_shape(w.gpus_per_worker, w.nodes_per_worker, node_gpus, tasks_per_node=w.tasks_per_node,
                     nodes_in_job=job.nodes if "nodes" in job.model_fields_set else 0, where=f"nodes of {where}")
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _validate_policy_tables(config: ElasticConfig, source: str) -> None:
    """Check ``[autoscaler]`` and ``[queue]`` with their own validators, now."""
    from slurm_elastic.core.autoscaler_config import AutoscalerConfig
    from slurm_elastic.rollouts.queue import QueueConfig

    try:
        scaler = AutoscalerConfig.from_mapping(config.autoscaler)
        QueueConfig.from_mapping(config.queue)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if config.workers.initial_workers > scaler.max_workers:
        raise ConfigError(f"{source}: workers.initial_workers ({config.workers.initial_workers}) > "
                          f"autoscaler.max_workers ({scaler.max_workers})")
    starting = config.workers.initial_workers if config.workers.initial_workers >= 0 else scaler.min_workers
    if starting == 0 and (scaler.max_workers == 0 or not scaler.enabled):
        # legal (an operator's `scale` starts them), but most likely a slip: said, not refused
        log.warning("%s: no worker ever starts on its own: %s; the trainer waits for rollouts until an operator's "
                    "`slurm-elastic scale JOB N`", source,
                    "autoscaler.max_workers = 0" if scaler.max_workers == 0
                    else "the autoscaler is off and workers.initial_workers is 0")
    _durations_fit_the_job(config, scaler, source)


def _durations_fit_the_job(config: ElasticConfig, scaler: AutoscalerConfig, source: str) -> None:
    """A timer not shorter than the job's ``job.time_limit`` (or a burst job's) never fires within it;
    only values other than the defaults are compared (a default is not held against a short job)."""
    limit_s = time_limit_s(config.job.time_limit)
    defaults = (type(scaler)(), type(config.workers)(), type(config.burst)())
    timers = {"autoscaler.scale_up_cooldown_s": (scaler.scale_up_cooldown_s, "after one scale-up no other could come"),
              "autoscaler.scale_down_cooldown_s": (scaler.scale_down_cooldown_s, "after one scale-down no other could come"),
              "autoscaler.min_stable_period_s": (scaler.min_stable_period_s, "the autoscaler would never act"),
              "workers.start_timeout_s": (config.workers.start_timeout_s, "a failed launch would never be caught"),
              "workers.heartbeat_grace_s": (config.workers.heartbeat_grace_s, "a hung worker would never be replaced"),
              "workers.drain_timeout_s": (config.workers.drain_timeout_s, "a worker that ignores its drain would never be cancelled")}
    for key, (value_s, why) in timers.items() if limit_s else ():
        section = defaults[0] if key.startswith("autoscaler.") else defaults[1]
        if value_s >= limit_s and value_s != getattr(section, key.split(".")[1]):
            raise ConfigError(f"{source}: {key} ({value_s:g}) is not shorter than job.time_limit "
                              f"({config.job.time_limit} = {limit_s} s): {why} within the job")
    burst = config.burst
    burst_limit_s = time_limit_s(burst.time_limit)
    if (burst.max_jobs and burst_limit_s and burst.controller_unreachable_grace_s >= burst_limit_s
            and burst.controller_unreachable_grace_s != defaults[2].controller_unreachable_grace_s):
        raise ConfigError(f"{source}: burst.controller_unreachable_grace_s ({burst.controller_unreachable_grace_s:g}) "
                          f"is not shorter than burst.time_limit ({burst.time_limit} = {burst_limit_s} s): a burst "
                          "job whose controller is gone would hold its GPUs to its time limit")


def worker_floor(config: ElasticConfig) -> tuple[str, int]:
    """The key that sets the fewest workers the job keeps, and their count: ``autoscaler.min_workers``,
    or with the autoscaler off the fixed pool of ``workers.initial_workers`` (-1: min_workers)."""
    from slurm_elastic.core.autoscaler_config import AutoscalerConfig

    scaler = AutoscalerConfig.from_mapping(config.autoscaler)
    if not scaler.enabled and config.workers.initial_workers >= 0:
        return "workers.initial_workers", config.workers.initial_workers
    return "autoscaler.min_workers", scaler.min_workers


def most_burst_workers(config: ElasticConfig) -> int:
    """Workers all of ``[burst]``'s jobs hold at once (0 without burst jobs)."""
    from slurm_elastic.core.placement import burst_job_slots

    burst = config.burst
    return burst.max_jobs * burst_job_slots(burst.gpus_per_job, burst.nodes_per_job, config.workers.gpus_per_worker)


def check_worker_command(config: ElasticConfig, source: str) -> None:
    """A job needs a worker command (a config without one still loads for tools and tests)."""
    if not config.workers.command:
        raise ConfigError(f"{source}: workers.command is empty: name the worker to run on each GPU")


def load_config(path: Path) -> ElasticConfig:
    """Read and validate ``elastic.toml``."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    return parse_config(data, str(path))


def config_reference_markdown() -> str:
    """A markdown table of every key of [controller], [workers], [agent], [weights], [job] and [burst], from the schema."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for section, model in (("controller", ControllerSection), ("workers", WorkersSection), ("agent", AgentSection),
                           ("weights", WeightsSection), ("job", JobSection), ("burst", BurstSection)):
        for name, field in model.model_fields.items():
            default = field.default_factory() if field.default_factory else field.default  # type: ignore[call-arg]
            choices = get_args(field.annotation) if get_origin(field.annotation) is Literal else ()
            annotation = ("one of " + ", ".join(map(str, choices)) if choices
                          else getattr(field.annotation, "__name__", str(field.annotation)).replace("typing.", ""))
            rows.append(f"| `{section}.{name}` | {annotation}{_range(field.metadata)} | `{default!r}` | {field.description} |")
    return "\n".join(rows) + "\n"


def _range(metadata: list[Any]) -> str:
    """A field's bounds as the reference writes them (``, 1 to 65535``, ``, > 0 to 31622400``)."""
    bounds = {kind.__name__: getattr(m, attr) for m in metadata
              for kind, attr in ((at.Ge, "ge"), (at.Gt, "gt"), (at.Le, "le")) if isinstance(m, kind)}
    low = f">= {shown(bounds['Ge'])}" if "Ge" in bounds else f"> {shown(bounds['Gt'])}" if "Gt" in bounds else ""
    if "Le" not in bounds:
        return f", {low}" if low else ""
    return f", {low.removeprefix('>= ')} to {shown(bounds['Le'])}" if low else f", at most {shown(bounds['Le'])}"


REFERENCE_HEADER = """# Configuration reference (`elastic.toml`)

Generated from the schema in `slurm_elastic/controller/config_sections.py` by
`python -m slurm_elastic.controller.config`; a test fails when this file and the schema differ.
The `[autoscaler]`, `[queue]` and `[health]` tables are documented in their own pages
([autoscaler.md](autoscaler.md), [queue.md](queue.md), [gpu-health.md](gpu-health.md)).
A key in the wrong table is refused with the key that does the job
(`workers.requests_per_worker_capacity`: set `autoscaler.requests_per_worker_capacity`).
Each number's range is in its type column (`> 0 to 31622400`: above 0, at most that); the largest
values are past any real setting (`slurm_elastic/core/limits.py` says why each: a duration at most
a year, which no Slurm job runs, 65535 CPUs, 2^30 MB, 40000 workers). Keys of several tables are
checked together too; each error names the keys: a timer the file sets (`autoscaler.scale_up_cooldown_s`,
`scale_down_cooldown_s`, `min_stable_period_s`, `workers.start_timeout_s`, `heartbeat_grace_s`,
`drain_timeout_s`) not shorter than `job.time_limit` would never fire within the job, and a
`burst.controller_unreachable_grace_s` set must be shorter than `burst.time_limit` (defaults are
not held against a short job). `job.time_limit` and `burst.time_limit` take Slurm's forms (`M`, `M:S`,
`H:M:S`, `D-H`, `D-H:M`, `D-H:M:S`, `UNLIMITED`) up to 35791393 minutes (`24855-03:13:00`): sbatch
takes a longer one without a word and Slurm wraps it (4294967297 minutes became one minute).
`render` refuses an `autoscaler.min_workers` (with the autoscaler off, a `workers.initial_workers`)
above the workers the job's nodes, less `job.trainer_gpus`, and all of its burst jobs can ever hold;
the controller says so at start from its real allocation. The servers' keys (`workers.readiness_path`, `liveness_*`,
`server_drain_grace_s`, `[weights]`) are refused unless `workers.kind = "server"` (read by nothing
otherwise); `[agent]` keys beside `agent.enabled = false` load with a warning (kept for when the
agents are turned on again), as does a job where no worker ever starts on its own
(`autoscaler.max_workers = 0`, or the autoscaler off with `workers.initial_workers = 0`: only an
operator's `slurm-elastic scale` starts them).

"""


if __name__ == "__main__":
    print(REFERENCE_HEADER + config_reference_markdown(), end="")
