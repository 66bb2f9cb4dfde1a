"""``slurm-elastic controller --config elastic.toml``: the controller process inside an allocation."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

from slurm_elastic.controller.config import ElasticConfig
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.state import job_state_dir
from slurm_elastic.errors import ConfigError, SlurmError
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


def build_controller(config: ElasticConfig, job_id: int, controller_url: str = "",
                     token_file: Path | None = None) -> Controller:
    """A controller for ``job_id``: the job must be running; its GPUs come from Slurm (or the config)."""
    set_command_timeout(config.controller.slurm_timeout_s)
    backend = select_backend(config.controller.slurm_backend)
    job = backend.job_info(job_id)
    if not job.is_running:
        raise SlurmError(f"job {job_id} is {job.state}, not RUNNING")
    gpus_by_node = dict(job.gpus_by_node)
    if config.controller.gpus_per_node or not gpus_by_node:
        per_node = config.controller.gpus_per_node
        gpus_by_node = {node: tuple(range(per_node)) for node in job.nodes}
    state_dir = job_state_dir(job_id, config.controller.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    (state_dir / "logs").mkdir(exist_ok=True)
    log.info("job %d: nodes %s, GPUs %s, state in %s, backend %s", job_id, ",".join(job.nodes),
             gpus_by_node, state_dir, backend.name)
    return Controller(config, job_id, backend, state_dir, gpus_by_node=gpus_by_node,
                      controller_url=controller_url, token_file=token_file)


def install_stop_handlers(stop: threading.Event) -> None:
    """SIGTERM/SIGINT only set the stop flag; worker steps live on (they are not our children)."""
    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping the controller (worker steps keep running)", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
