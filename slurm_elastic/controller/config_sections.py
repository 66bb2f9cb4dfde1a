"""The tables of ``elastic.toml``, key by key: controller, workers, weights, agent, job, health."""

from __future__ import annotations

import re
import shlex
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from slurm_elastic.controller.burst_config import SlurmNames, SlurmTime
from slurm_elastic.core import defaults as d
from slurm_elastic.core.health import CLOCK_EVENT_FLAGS, HealthRules
from slurm_elastic.core.limits import (
    MAX_CPUS,
    MAX_DURATION_S,
    MAX_GPUS,
    MAX_MEM_MB,
    MAX_NODES,
    MAX_REPEATS,
    MAX_WORKERS,
)
from slurm_elastic.core.signals import DEFAULT_DRAIN_SIGNAL, DrainSignal


class StrictSection(BaseModel):
    """Strict, as TOML is typed: no numbers as strings, no booleans as numbers, finite floats."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        """No NUL character in any text: no path, argument or environment of the OS can hold one."""
        texts = value if isinstance(value, list) else [*value, *value.values()] if isinstance(value, dict) else [value]
        if any(isinstance(t, str) and "\x00" in t for t in texts):
            raise ValueError("holds a NUL character (\\x00), which no path, argument or environment variable can hold")
        return value


class ControllerSection(StrictSection):
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
    slurm_timeout_s: float = Field(d.SLURM_TIMEOUT_S, gt=0, le=3600, description="Timeout of one Slurm command the controller runs "
                                   "(squeue, sinfo, scontrol, scancel, sbatch); worker srun steps are not timed.")
    gpus_per_node: int = Field(0, ge=0, le=MAX_GPUS, description="GPUs per node of the allocation; 0 reads it from Slurm.")

    @field_validator("state_dir")
    @classmethod
    def _known_placeholders(cls, value: str) -> str:
        unknown = sorted(set(PLACEHOLDER.findall(value)) - {"cluster", "job_id"})
        if unknown:
            raise ValueError(f"unknown placeholder {', '.join('{' + n + '}' for n in unknown)}; the known ones are "
                             "{cluster} and {job_id}")
        return value


COMMAND_PLACEHOLDERS = ("worker_id", "gpus", "nodes", "controller_url", "job_id", "state_dir", "port",
                        "weights_path", "weights_version")  # filled in workers.command (step_specs, the wrapper)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")  # {name}, not a shell's ${name}


class WorkersSection(StrictSection):
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
    cpus_per_worker: int = Field(1, ge=1, le=MAX_CPUS, description="CPUs per worker step (--cpus-per-task).")
    mem_per_worker_mb: int = Field(0, ge=0, le=MAX_MEM_MB, description="Memory per worker step in MB; 0: Slurm's default (needed, with job.trainer_mem_mb, when job.mem_per_node_mb is set).")
    initial_workers: int = Field(-1, ge=-1, le=MAX_WORKERS, description="Workers at start (at most autoscaler.max_workers); -1: the autoscaler's minimum. The count the job keeps with the autoscaler off; with it on, its start-up resizes the pool from the first tick (doubling it, or a worker on every GPU while the trainer waits for its first batches: docs/autoscaler.md).")
    drain_signal: DrainSignal = Field(DEFAULT_DRAIN_SIGNAL, description="Signal that asks a worker to drain.")
    drain_timeout_s: float = Field(d.DRAIN_TIMEOUT_S, gt=0, le=MAX_DURATION_S, description="After this, a draining worker is cancelled.")
    end_drain_s: float = Field(d.DRAIN_TIMEOUT_S, ge=0, le=MAX_DURATION_S, description=(
        "This long before the job's time limit (at most a quarter of the job's whole time) every worker "
        "drains, finishing its rollout, and none is launched; a raised limit or a requeue brings them "
        "back. 0: never."))
    heartbeat_interval_s: float = Field(d.HEARTBEAT_INTERVAL_S, gt=0, le=MAX_DURATION_S, description="How often workers heart-beat (longer in a pool larger than max_heartbeats_per_s allows).")
    heartbeat_grace_s: float = Field(d.HEARTBEAT_GRACE_S, gt=0, le=MAX_DURATION_S, description="Silence after which a worker is killed and replaced.")
    max_heartbeats_per_s: float = Field(d.MAX_HEARTBEATS_PER_S, ge=0.1, le=100_000, description=(
        "Heartbeats a second the controller aims to answer: for more senders (a wrapper per worker step, "
        "plus the SDK in each of its tasks) than max_heartbeats_per_s x heartbeat_interval_s, workers "
        "are told a longer interval, at most heartbeat_grace_s / 4 (past that the rate grows again)."))
    start_timeout_s: float = Field(d.START_TIMEOUT_S, gt=0, le=MAX_DURATION_S, description="Launch to registration, else the launch failed.")
    backoff_base_s: float = Field(d.BACKOFF_BASE_S, gt=0, le=MAX_DURATION_S, description="First crash-loop backoff; doubles per crash.")
    backoff_max_s: float = Field(d.BACKOFF_MAX_S, gt=0, le=MAX_DURATION_S, description="Longest crash-loop backoff.")
    readiness_path: str = Field("", description="Servers: HTTP path (starting with /) that answers 2xx when ready; empty: a TCP connect.")
    liveness_path: str = Field("", description="Servers: HTTP path (starting with /) probed after ready (2xx: live); empty: readiness_path (empty too: a TCP connect).")
    liveness_interval_s: float = Field(d.LIVENESS_INTERVAL_S, gt=0, le=3600, description="Servers: seconds between liveness probes after ready.")
    liveness_timeout_s: float = Field(d.LIVENESS_TIMEOUT_S, gt=0, le=3600, description="Servers: a liveness probe not answered within this fails.")
    liveness_failure_threshold: int = Field(3, ge=0, le=1000, description="Servers: failed probes in a row after which the server leaves discovery, drains and is replaced; 0: no liveness probes.")
    server_drain_grace_s: float = Field(d.SERVER_DRAIN_GRACE_S, ge=0, le=MAX_DURATION_S, description="Servers: after leaving discovery, wait at least this long (routers catch up) before signalling.")
    gpu_memory_mb: int = Field(0, ge=0, le=MAX_MEM_MB, description="Pre-flight: free memory a worker needs on its GPU; 0 skips the check.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for worker steps.")

    @field_validator("command", mode="before")
    @classmethod
    def _split_command(cls, value: Any) -> Any:
        return shlex.split(value) if isinstance(value, str) else value

    @field_validator("command")
    @classmethod
    def _known_placeholders(cls, value: list[str]) -> list[str]:
        if value and not value[0].strip():
            raise ValueError(f"its first word, the program to run, is empty ({value[0]!r})")
        unknown = sorted({name for part in value for name in PLACEHOLDER.findall(part)} - set(COMMAND_PLACEHOLDERS))
        if unknown:
            raise ValueError(f"unknown placeholder {', '.join('{' + n + '}' for n in unknown)}; the known ones are "
                             f"{', '.join('{' + n + '}' for n in COMMAND_PLACEHOLDERS)} (a shell variable is "
                             "written ${NAME})")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        bad = [name for name in value if not ENV_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not an environment variable's name (letters, digits and _, not "
                             "starting with a digit)")
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


class WeightsSection(StrictSection):
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


class AgentSection(StrictSection):
    """The per-node GPU health agents (one ``srun --overlap`` step per node)."""

    enabled: bool = Field(True, description="Run an agent per node (GPU telemetry); while on, a node whose agent is not heard from for health.agent_silence_s gets no new workers. false: no agents, and every node is placed on.")
    source: Literal["auto", "nvml", "inject"] = Field(
        "auto", description="NVML; the fault-injection file; or auto: NVML, and the file only on nodes without an NVIDIA driver.")
    inject_file: str = Field("", description="Fault-injection drill file (docs/gpu-health.md); default <state dir>/drill.toml.")
    interval_s: float = Field(d.AGENT_INTERVAL_S, ge=0.1, le=MAX_DURATION_S, description="Seconds between samples (at least 0.1; below "
                              "health.agent_silence_s, after which a node not heard from is of unknown health).")


class JobSection(StrictSection):
    """The batch job that ``slurm-elastic render`` writes (the controller itself ignores this table)."""

    name: str = Field("elastic-rl", description="Job name (#SBATCH --job-name).")
    nodes: int = Field(2, ge=1, le=MAX_NODES, description="Nodes (#SBATCH --nodes).")
    gpus_per_node: int = Field(4, ge=0, le=MAX_GPUS, description="GPUs per node (#SBATCH --gres=gpu:N).")
    cpus_per_node: int = Field(0, ge=0, le=MAX_CPUS, description="CPUs per node; 0 takes whole nodes (--exclusive).")
    mem_per_node_mb: int = Field(0, ge=0, le=MAX_MEM_MB, description="Memory per node in MB (#SBATCH --mem); 0: all of each "
                                 "node's memory, which on a cluster that schedules memory takes the nodes whole "
                                 "whatever cpus_per_node says.")
    time_limit: SlurmTime = Field("", description="#SBATCH --time in one of Slurm's forms (M, M:S, H:M:S, D-H, "
                                  "D-H:M, D-H:M:S, UNLIMITED), e.g. 04:00:00; at most 35791393 minutes "
                                  "(24855-03:13:00: Slurm wraps a longer one); empty: the partition's default.")
    partition: SlurmNames = Field("", description="#SBATCH --partition; empty: the default partition.")
    output: str = Field("slurm-elastic-%j.out", description="#SBATCH --output.")
    setup: str = Field("", description="Shell lines run first (e.g. activating a virtual environment).")
    trainer_command: list[str] = Field(default_factory=list, description=(
        "The trainer, run as its own step (`render` refuses an empty one); it starts with USR1 and USR2 (the "
        "drain signals) ignored."))
    trainer_gpus: int = Field(1, ge=0, le=MAX_GPUS, description="GPUs of the trainer step; 0: none (its step names "
                              "`--gres=none`, so all of its node's GPUs take workers). `render` refuses a job where no worker "
                              "fits beside it (a worker over k nodes needs k nodes with its GPUs free).")
    trainer_mem_mb: int = Field(0, ge=0, le=MAX_MEM_MB, description="Memory of the trainer step in MB (srun --mem); 0: Slurm's "
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
MIN_CRASH_WINDOW_S = 1.0  # crashes are counted at ticks: a shorter window holds no two of them


class HealthSection(StrictSection):
    """GPU health rules (docs/gpu-health.md). Strict: no numbers as strings, no booleans as numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
    max_temperature_c: float = Field(_RULES.max_temperature_c, ge=0, le=200)  # GPUs shut down near 100 C
    cordon_clock_events: list[str] = Field(sorted(_RULES.cordon_clock_events))
    max_ecc_uncorrectable_volatile: int = Field(_RULES.max_ecc_uncorrectable_volatile, ge=0, le=2**31)
    cordon_on_unreadable: bool = _RULES.cordon_on_unreadable
    healthy_period_s: float = Field(_RULES.healthy_period_s, ge=0, le=MAX_DURATION_S)
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
    crash_threshold: int = Field(_RULES.crash_threshold, ge=1, le=MAX_REPEATS)
    crash_window_s: float = Field(_RULES.crash_window_s, ge=0, le=MAX_DURATION_S)  # at least 1 s: _a_window
    crash_cordon_s: float = Field(_RULES.crash_cordon_s, ge=0, le=MAX_DURATION_S)
    agent_silence_s: float = Field(_RULES.agent_silence_s, gt=0, le=MAX_DURATION_S)  # 0 would make every node unknown at once

    @field_validator("crash_window_s")
    @classmethod
    def _a_window(cls, value: float, info: ValidationInfo) -> float:
        """A window under 1 s turns the crash guard off without a word when crash_threshold is above
        1: crashes are counted at the controller's ticks, so no two fall in it. With a threshold of
        1 every crash cordons whatever the window (0 included)."""
        threshold = info.data.get("crash_threshold", _RULES.crash_threshold)
        if value < MIN_CRASH_WINDOW_S and threshold != 1:
            raise ValueError(f"must be at least {MIN_CRASH_WINDOW_S:g} s: a window of {value:g} s holds no two "
                             f"crashes (they are counted at the controller's ticks), so the crash_threshold "
                             f"({threshold}) crashes that cordon a GPU never come together and a GPU that crashes "
                             f"every worker is never cordoned; leave it at {_RULES.crash_window_s:g} s, or set "
                             "crash_threshold = 1 to cordon at the first crash")
        return value

    @field_validator("cordon_clock_events")
    @classmethod
    def _known_clock_events(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - set(CLOCK_EVENT_FLAGS))
        if unknown:
            raise ValueError(f"unknown clock event {unknown[0]!r} (known: {', '.join(CLOCK_EVENT_FLAGS)})")
        return value

    def rules(self) -> HealthRules:
        return HealthRules(**{**self.model_dump(), "cordon_clock_events": frozenset(self.cordon_clock_events)})
