"""``slurm-elastic controller --config elastic.toml``: the controller process inside an allocation."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

from slurm_elastic.client.files import STATE_DIR_POINTER, job_state_dir
from slurm_elastic.client.locate import state_dir_from_comment
from slurm_elastic.controller.config import ElasticConfig, most_burst_workers, worker_floor
from slurm_elastic.controller.files import write_text_atomic
from slurm_elastic.controller.job_dir import ClaimedDir, claim_state_dir
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.job_identity import JobIdentity
from slurm_elastic.core.placement import most_workers
from slurm_elastic.core.pressure import QueueFeed
from slurm_elastic.core.shape import shape_for_allocation
from slurm_elastic.errors import ConfigError, SlurmError
from slurm_elastic.slurm.backend import SlurmBackend
from slurm_elastic.slurm.parse import JobInfo
from slurm_elastic.slurm.pyslurm_backend import select_backend
from slurm_elastic.slurm.runner import set_command_timeout

log = logging.getLogger(__name__)


def job_id_from_env() -> int:
    """The allocation's job id, or a clear refusal outside one."""
    value = os.environ.get("SLURM_JOB_ID", "")
    if not value.isdigit():
        raise ConfigError(
            "the controller runs inside a Slurm allocation and SLURM_JOB_ID is not set: start it from "
            "your batch script (see examples/elastic_rl.sbatch) or inside salloc"
        )
    return int(value)


def slurm_backend(config: ElasticConfig) -> SlurmBackend:
    """The Slurm backend the config asks for, its commands bounded by ``controller.slurm_timeout_s``."""
    set_command_timeout(config.controller.slurm_timeout_s)
    return select_backend(config.controller.slurm_backend)


def running_job(backend: SlurmBackend, job_id: int) -> JobInfo:
    """The allocation as Slurm describes it; SlurmError unless it is running."""
    job = backend.job_info(job_id)
    if not job.is_running:
        raise SlurmError(f"job {job_id} is {job.state}, not RUNNING")
    return job


def job_identity(job: JobInfo) -> JobIdentity:
    """Who the job is: its cluster (from Slurm, else the job's environment), id, submit time."""
    cluster = job.cluster or os.environ.get("SLURM_CLUSTER_NAME", "")
    return JobIdentity(cluster, job.job_id, job.submit_time_s, job.restart_count, job.user_name)


def open_state_dir(config: ElasticConfig, job: JobInfo) -> ClaimedDir:
    """The job's state directory, made this job's (another job's is moved aside, with a note)."""
    identity = job_identity(job)
    path = job_state_dir(identity.cluster, job.job_id, config.controller.state_dir)
    named = state_dir_from_comment(job.comment)
    claimed = claim_state_dir(path, identity, named_by_job=named is not None and named.absolute() == path.absolute())
    (claimed.path / "logs").mkdir(exist_ok=True)
    if claimed.note:
        log.error("%s", claimed.note)
    if config.controller.state_dir:
        point_to_state_dir(job_state_dir(identity.cluster, job.job_id), claimed.path)
    return claimed


def point_to_state_dir(default_dir: Path, state_dir: Path) -> None:
    """Name a configured state directory in the job's default one, so that the CLI finds the
    controller while Slurm does not answer (it reads the job's comment otherwise). Best effort:
    a home the batch host cannot write only loses that."""
    if default_dir.absolute() == state_dir.absolute():
        return
    try:
        default_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(default_dir / STATE_DIR_POINTER, f"{state_dir.absolute()}\n", mode=0o644)
    except OSError as exc:
        log.info("could not name the state directory in %s (the CLI then finds it through Slurm only): %s",
                 default_dir, exc)


def allocation_gpus(config: ElasticConfig, job: JobInfo) -> dict[str, tuple[int, ...]]:
    """The job's GPU indexes on each of its nodes: from Slurm, or ``controller.gpus_per_node``."""
    gpus_by_node = dict(job.gpus_by_node)
    if config.controller.gpus_per_node or not gpus_by_node:
        per_node = config.controller.gpus_per_node
        gpus_by_node = {node: tuple(range(per_node)) for node in job.nodes}
    return gpus_by_node


def check_worker_shape(config: ElasticConfig, job: JobInfo) -> None:
    """ConfigError unless one worker step fits the job's nodes (checked before the state dir is opened)."""
    w = config.workers
    shape_for_allocation(w.gpus_per_worker, w.nodes_per_worker, w.tasks_per_node, allocation_gpus(config, job))


def unplaceable_floor(config: ElasticConfig, gpus_by_node: dict[str, tuple[int, ...]], trainer_node: str = "") -> str:
    """What to say when the fewest workers the job keeps (:func:`worker_floor`) are more than the
    allocation's GPUs, less ``job.trainer_gpus`` on the trainer's node (``trainer_node``, the batch
    host; the first node if not one of them), and all of ``[burst]``'s jobs can ever hold ('' when
    they fit), as render counts them: the controller runs those that fit and never places the others."""
    w, trainer_gpus = config.workers, config.job.trainer_gpus
    if not w.gpus_per_worker:
        return ""
    key, floor = worker_floor(config)
    shape = shape_for_allocation(w.gpus_per_worker, w.nodes_per_worker, w.tasks_per_node, gpus_by_node)
    trainer_node = trainer_node if trainer_node in gpus_by_node else next(iter(gpus_by_node), "")
    free = [len(gpus) - (trainer_gpus if node == trainer_node else 0) for node, gpus in gpus_by_node.items()]
    slots = most_workers(free, shape.gpus, shape.nodes)
    burst = most_burst_workers(config)
    if floor <= slots + burst:
        return ""
    gpus = sum(len(g) for g in gpus_by_node.values())
    lent = f" and the burst.max_jobs = {config.burst.max_jobs} burst job(s) at most {burst} more" if burst else ""
    return (f"{key} = {floor} workers can never all be placed: this job's {len(gpus_by_node)} node(s) with {gpus} "
            f"GPUs, job.trainer_gpus = {trainer_gpus} of them the trainer's, hold at most {slots} of "
            f"workers.gpus_per_worker = {w.gpus_per_worker}{lent}. The controller runs the {slots + burst} that fit "
            f"and never places the other {floor - slots - burst} (status: 'only N GPU slots usable now'); set {key} "
            f"to at most {slots + burst}")


def build_controller(config: ElasticConfig, job: JobInfo, backend: SlurmBackend, state_dir: Path,
                     controller_url: str = "", token_file: Path | None = None,
                     queue: QueueFeed | None = None) -> Controller:
    """A controller for the running ``job``: its GPUs come from Slurm (or the config)."""
    gpus_by_node = allocation_gpus(config, job)
    log.info("job %d: nodes %s, GPUs %s, state in %s, backend %s", job.job_id, ",".join(job.nodes),
             gpus_by_node, state_dir, backend.name)
    controller = Controller(config, job.job_id, backend, state_dir, gpus_by_node=gpus_by_node,
                            controller_url=controller_url, token_file=token_file, queue=queue)
    controller.note_job_times(job)
    if note := unplaceable_floor(config, gpus_by_node, job.batch_host):
        controller.note_config(note)
    return controller


def install_stop_handlers(stop: threading.Event) -> None:
    """SIGTERM/SIGINT only set the stop flag; worker steps live on (they are not our children)."""
    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping the controller (worker steps keep running)", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
