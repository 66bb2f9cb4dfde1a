"""``elastic.toml``: the controller's configuration, validated, with units in every key name.

Unknown keys and bad values are errors that name the key (``workers.gpus_per_worker: ...``).
``[health]`` becomes the core's :class:`~slurm_elastic.core.health.HealthRules` here; the
``[autoscaler]`` and ``[queue]`` tables are validated by their own modules, at load time too, so a
bad value is refused before anything touches Slurm.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from slurm_elastic.controller.burst_config import BurstSection, SlurmNames, SlurmTime, time_limit_s
from slurm_elastic.core import defaults as d
from slurm_elastic.core.health import CLOCK_EVENT_FLAGS, HealthRules
from slurm_elastic.core.signals import DEFAULT_DRAIN_SIGNAL, DrainSignal
from slurm_elastic.errors import ConfigError, unknown_key

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class _Section(BaseModel):
    """Strict, as TOML is typed: no numbers as strings, no booleans as numbers, finite floats."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ControllerSection(_Section):
    """Where the controller keeps its state and how often it reconciles."""

    tick_interval_s: float = Field(d.TICK_INTERVAL_S, gt=0, le=600, description="Seconds between reconcile ticks.")
    allocation_check_s: float = Field(d.ALLOCATION_CHECK_S, gt=0, le=3600, description="Seconds between two reads of "
                                      "the job's nodes (a node that left it), their states (drained or down: "
                                      "cordoned) and comment (set back if someone changed it); a worker step that "
                                      "ended unasked also triggers one.")
    state_dir: str = Field("", description="State directory; default ~/.slurm-elastic/jobs/<cluster>/<job id>; {cluster} and {job_id} are filled in.")
    listen_host: str = Field("", description="Address to serve the API on; default: this host's name's address, or where that "
                             "is loopback (a stock Debian /etc/hosts), the first interface up that is not.")
    listen_port: int = Field(0, ge=0, le=65535, description="API port; 0: the port of the job's previous controller if it is free again, else any free one.")
    slurm_backend: Literal["auto", "cli", "pyslurm"] = Field("auto", description="How to talk to Slurm.")
    slurm_timeout_s: float = Field(d.SLURM_TIMEOUT_S, gt=0, description="Timeout of one Slurm command the controller runs "
                                   "(squeue, sinfo, scontrol, scancel, sbatch); worker srun steps are not timed.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node of the allocation; 0 reads it from Slurm.")


COMMAND_PLACEHOLDERS = ("worker_id", "gpus", "nodes", "controller_url", "job_id", "state_dir", "port",
                        "weights_path", "weights_version")  # filled in workers.command (step_specs, the wrapper)
PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")  # {name}, not a shell's ${name}


class WorkersSection(_Section):
    """What a worker step runs and what it gets."""

    command: list[str] = Field(
        default_factory=list,
        description="Worker command (a job needs one: `controller` and `render` refuse an empty one); a string is split like a shell would. Placeholders: {worker_id}, "
        "{gpus} (in all), {nodes} (of one worker's step), {controller_url}, {job_id}, {state_dir}, {port}, {weights_path}, {weights_version} (servers: the "
        "latest published weights at launch); any other {name} is refused at load (a shell variable: ${NAME}).",
    )
    kind: Literal["rollout", "server"] = Field("rollout", description="Rollout loop or inference server.")
    gpus_per_worker: int = Field(1, ge=0, le=64, description="GPUs per worker in all (--gres=gpu:N on one node); above "
                                 "a node's GPUs: one step over whole nodes (docs/servers.md); 0: CPU-only workers, "
                                 "placed by CPUs (not with [burst]).")
    nodes_per_worker: int = Field(0, ge=0, le=64, description="Nodes one worker step spans (--nodes), each with "
                                  "gpus_per_worker / nodes_per_worker GPUs; 0: 1, or whole nodes when gpus_per_worker "
                                  "is above a node's GPUs.")
    tasks_per_node: int = Field(1, ge=1, le=256, description="Tasks of a worker step on each of its nodes "
                                "(--ntasks-per-node); task 0 registers, the others run the command beside it.")
    cpus_per_worker: int = Field(1, ge=1, description="CPUs per worker step (--cpus-per-task).")
    mem_per_worker_mb: int = Field(0, ge=0, description="Memory per worker step in MB; 0: Slurm's default (needed, with job.trainer_mem_mb, when job.mem_per_node_mb is set).")
    initial_workers: int = Field(-1, ge=-1, description="Workers at start (at most autoscaler.max_workers); -1: the autoscaler's minimum. The count the job keeps with the autoscaler off; with it on, its start-up resizes the pool from the first tick (doubling it, or a worker on every GPU while the trainer waits for its first batches: docs/autoscaler.md).")
    drain_signal: DrainSignal = Field(DEFAULT_DRAIN_SIGNAL, description="Signal that asks a worker to drain.")
    drain_timeout_s: float = Field(d.DRAIN_TIMEOUT_S, gt=0, description="After this, a draining worker is cancelled.")
    end_drain_s: float = Field(d.DRAIN_TIMEOUT_S, ge=0, description=(
        "This long before the job's time limit (at most a quarter of the job's whole time) every worker "
        "drains, finishing its rollout, and none is launched; a raised limit or a requeue brings them "
        "back. 0: never."))
    heartbeat_interval_s: float = Field(d.HEARTBEAT_INTERVAL_S, gt=0, description="How often workers heart-beat.")
    heartbeat_grace_s: float = Field(d.HEARTBEAT_GRACE_S, gt=0, description="Silence after which a worker is killed and replaced.")
    start_timeout_s: float = Field(d.START_TIMEOUT_S, gt=0, description="Launch to registration, else the launch failed.")
    backoff_base_s: float = Field(d.BACKOFF_BASE_S, gt=0, description="First crash-loop backoff; doubles per crash.")
    backoff_max_s: float = Field(d.BACKOFF_MAX_S, gt=0, description="Longest crash-loop backoff.")
    readiness_path: str = Field("", description="Servers: HTTP path (starting with /) that answers 2xx when ready; empty: a TCP connect.")
    liveness_path: str = Field("", description="Servers: HTTP path (starting with /) probed after ready (2xx: live); empty: readiness_path (empty too: a TCP connect).")
    liveness_interval_s: float = Field(d.LIVENESS_INTERVAL_S, gt=0, le=3600, description="Servers: seconds between liveness probes after ready.")
    liveness_timeout_s: float = Field(d.LIVENESS_TIMEOUT_S, gt=0, le=3600, description="Servers: a liveness probe not answered within this fails.")
    liveness_failure_threshold: int = Field(3, ge=0, le=1000, description="Servers: failed probes in a row after which the server leaves discovery, drains and is replaced; 0: no liveness probes.")
    server_drain_grace_s: float = Field(d.SERVER_DRAIN_GRACE_S, ge=0, description="Servers: after leaving discovery, wait at least this long (routers catch up) before signalling.")
    gpu_memory_mb: int = Field(0, ge=0, description="Pre-flight: free memory a worker needs on its GPU; 0 skips the check.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for worker steps.")

    @field_validator("command", mode="before")
    @classmethod
    def _split_command(cls, value: Any) -> Any:
        return shlex.split(value) if isinstance(value, str) else value

    @field_validator("command")
    @classmethod
    def _known_placeholders(cls, value: list[str]) -> list[str]:
        unknown = sorted({name for part in value for name in PLACEHOLDER.findall(part)} - set(COMMAND_PLACEHOLDERS))
        if unknown:
            raise ValueError(f"unknown placeholder {', '.join('{' + n + '}' for n in unknown)}; the known ones are "
                             f"{', '.join('{' + n + '}' for n in COMMAND_PLACEHOLDERS)} (a shell variable is "
                             "written ${NAME})")
        return value

    @field_validator("readiness_path", "liveness_path")
    @classmethod
    def _a_path(cls, value: str) -> str:
        if value and not value.startswith("/"):
            raise ValueError(f"{value!r} must start with / (e.g. /health), or be empty for a TCP connect")
        return value

    @model_validator(mode="after")
    def _heartbeats_fit_their_grace(self) -> WorkersSection:
        if self.heartbeat_grace_s < 2 * self.heartbeat_interval_s:
            raise ValueError(f"workers.heartbeat_grace_s ({self.heartbeat_grace_s:g}) must be at least twice "
                             f"workers.heartbeat_interval_s ({self.heartbeat_interval_s:g}): a healthy worker "
                             "would be killed between two of its heartbeats")
        if self.backoff_base_s > self.backoff_max_s:
            raise ValueError(f"workers.backoff_base_s ({self.backoff_base_s:g}) > workers.backoff_max_s "
                             f"({self.backoff_max_s:g})")
        return self


# the update hooks of [weights] presets: (method, path, JSON body); {version} and {path} are filled in
WEIGHTS_PRESETS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # SGLang's native server (v0.5+: weight_version): UpdateWeightFromDiskReqInput
    "sglang": ("POST", "/update_weights_from_disk", {"model_path": "{path}", "weight_version": "{version}"}),
    # vLLM's OpenAI server started with VLLM_SERVER_DEV_MODE=1: the worker's reload_weights
    "vllm": ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "{path}"}}),
}


class WeightsSection(_Section):
    """Servers: how the trainer's published weights reach every server (docs/servers.md)."""

    update: Literal["none", "sglang", "vllm", "http", "command"] = Field(
        "none", description="How a server loads new weights: a preset (sglang, vllm), an HTTP request (http: "
        "method, path, body) or a command (command); none: versions are shown, nothing is pushed.")
    method: Literal["POST", "PUT"] = Field("POST", description="update = http: the request's method.")
    path: str = Field("", description="update = http: the request's path on the server, e.g. /reload.")
    body: dict[str, Any] = Field(default_factory=dict, description="update = http: the JSON body; "
                                 "{version} and {path} in its strings are replaced.")
    command: list[str] = Field(default_factory=list, description="update = command: run on the controller's "
                               "host per server; placeholders {url}, {version}, {path}, {worker_id}; exit 0: loaded.")
    timeout_s: float = Field(d.WEIGHTS_TIMEOUT_S, gt=0, le=86400, description="One update's limit; a server not done by then failed it.")
    max_failures: int = Field(d.WEIGHTS_MAX_FAILURES, ge=1, le=100, description="Failed updates in a row after which a server is drained and replaced (only once another server has loaded that version; until then no server is replaced and the retries stop).")
    retry_backoff_s: float = Field(d.WEIGHTS_RETRY_BACKOFF_S, ge=0, le=3600, description="Wait before retrying a failed update; doubles per failure in a row.")
    parallel: int = Field(16, ge=1, le=256, description="Updates sent at once.")

    @field_validator("command", mode="before")
    @classmethod
    def _split_command(cls, value: Any) -> Any:
        return shlex.split(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _complete(self) -> WeightsSection:
        if self.update == "http" and not self.path.startswith("/"):
            raise ValueError("update = 'http' needs a path starting with /")
        if self.update == "command" and not self.command:
            raise ValueError("update = 'command' needs a command")
        if self.update in WEIGHTS_PRESETS and (self.path or self.body):
            raise ValueError(f"update = {self.update!r} is a preset: path and body are its own (use update = 'http')")
        return self


class AgentSection(_Section):
    """The per-node GPU health agents (one ``srun --overlap`` step per node)."""

    enabled: bool = Field(True, description="Run an agent per node (GPU telemetry); while on, a node whose agent is not heard from for health.agent_silence_s gets no new workers. false: no agents, and every node is placed on.")
    source: Literal["auto", "nvml", "inject"] = Field(
        "auto", description="NVML; the fault-injection file; or auto: NVML, and the file only on nodes without an NVIDIA driver.")
    inject_file: str = Field("", description="Fault-injection drill file (docs/gpu-health.md); default <state dir>/drill.toml.")
    interval_s: float = Field(d.AGENT_INTERVAL_S, ge=0.1, description="Seconds between samples (at least 0.1; below "
                              "health.agent_silence_s, after which a node not heard from is of unknown health).")


class JobSection(_Section):
    """The batch job that ``slurm-elastic render`` writes (the controller itself ignores this table)."""

    name: str = Field("elastic-rl", description="Job name (#SBATCH --job-name).")
    nodes: int = Field(2, ge=1, description="Nodes (#SBATCH --nodes).")
    gpus_per_node: int = Field(4, ge=0, description="GPUs per node (#SBATCH --gres=gpu:N).")
    cpus_per_node: int = Field(0, ge=0, description="CPUs per node; 0 takes whole nodes (--exclusive).")
    mem_per_node_mb: int = Field(0, ge=0, description="Memory per node in MB (#SBATCH --mem); 0: all of each "
                                 "node's memory, which on a cluster that schedules memory takes the nodes whole "
                                 "whatever cpus_per_node says.")
    time_limit: SlurmTime = Field("", description="#SBATCH --time, e.g. 04:00:00; empty: the partition's default.")
    partition: SlurmNames = Field("", description="#SBATCH --partition; empty: the default partition.")
    output: str = Field("slurm-elastic-%j.out", description="#SBATCH --output.")
    setup: str = Field("", description="Shell lines run first (e.g. activating a virtual environment).")
    trainer_command: list[str] = Field(default_factory=list, description=(
        "The trainer, run as its own step; it starts with USR1 and USR2 (the drain signals) ignored."))
    trainer_gpus: int = Field(1, ge=0, description="GPUs of the trainer step; 0: none (its step names "
                              "`--gres=none`, so all of its node's GPUs take workers).")
    trainer_mem_mb: int = Field(0, ge=0, description="Memory of the trainer step in MB (srun --mem); 0: Slurm's "
                                "default. Needed with mem_per_node_mb (below it, with the workers' memory).")

    @field_validator("trainer_command", mode="before")
    @classmethod
    def _split_trainer(cls, value: Any) -> Any:
        return shlex.split(value) if isinstance(value, str) else value

    @field_validator("name", "output")
    @classmethod
    def _one_sbatch_word(cls, value: str) -> str:
        if not value or any(c.isspace() or not c.isprintable() for c in value):
            raise ValueError(f"{value!r}: an #SBATCH value must be one word (no spaces or control characters)")
        return value



_RULES = HealthRules()  # the one place the [health] defaults live


class HealthSection(_Section):
    """GPU health rules (docs/gpu-health.md). Strict: no numbers as strings, no booleans as numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
    max_temperature_c: float = Field(_RULES.max_temperature_c, ge=0)
    cordon_clock_events: list[str] = Field(sorted(_RULES.cordon_clock_events))
    max_ecc_uncorrectable_volatile: int = Field(_RULES.max_ecc_uncorrectable_volatile, ge=0)
    cordon_on_unreadable: bool = _RULES.cordon_on_unreadable
    healthy_period_s: float = Field(_RULES.healthy_period_s, ge=0)
    on_unhealthy: Literal["drain", "keep"] = _RULES.on_unhealthy
    on_node_out: Literal["drain", "keep"] = Field(
        _RULES.on_node_out, description="A worker on a node Slurm marks drained, down, failing or rebooting "
        "(`scontrol update NodeName=N State=DRAIN`, read every `controller.allocation_check_s`): `drain` it "
        "(it hands over its rollout and leaves; its replacement goes elsewhere) or `keep` it. Either way no "
        "new worker goes there.")
    release_drained_nodes: bool = Field(
        _RULES.release_drained_nodes, description="Give a node Slurm marks out of use back to Slurm once no "
        "step but the node agents runs there (`scontrol update JobId=J NodeList=<the others>`); never the batch host, never "
        "the last node. Slurm does not give it back to the job: the job runs on without it.")
    crash_threshold: int = Field(_RULES.crash_threshold, ge=1)
    crash_window_s: float = Field(_RULES.crash_window_s, ge=0)
    crash_cordon_s: float = Field(_RULES.crash_cordon_s, ge=0)
    agent_silence_s: float = Field(_RULES.agent_silence_s, gt=0)  # 0 would make every node unknown at once

    @field_validator("cordon_clock_events")
    @classmethod
    def _known_clock_events(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - set(CLOCK_EVENT_FLAGS))
        if unknown:
            raise ValueError(f"unknown clock event {unknown[0]!r} (known: {', '.join(CLOCK_EVENT_FLAGS)})")
        return value

    def rules(self) -> HealthRules:
        return HealthRules(**{**self.model_dump(), "cordon_clock_events": frozenset(self.cordon_clock_events)})


class ElasticConfig(_Section):
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
            rows.append(f"| `{section}.{name}` | {annotation} | `{default!r}` | {field.description} |")
    return "\n".join(rows) + "\n"


REFERENCE_HEADER = """# Configuration reference (`elastic.toml`)

Generated from the schema in `slurm_elastic/controller/config.py` by
`python -m slurm_elastic.controller.config`; a test fails when this file and the schema differ.
The `[autoscaler]`, `[queue]` and `[health]` tables are documented in their own pages
([autoscaler.md](autoscaler.md), [queue.md](queue.md), [gpu-health.md](gpu-health.md)).
A key in the wrong table is refused with the key that does the job
(`workers.requests_per_worker_capacity`: set `autoscaler.requests_per_worker_capacity`).

"""


if __name__ == "__main__":
    print(REFERENCE_HEADER + config_reference_markdown(), end="")
