"""Render batch scripts from the jinja2 templates in ``templates/``."""

from __future__ import annotations

import shlex

import jinja2

from slurm_elastic.controller.config import ElasticConfig
from slurm_elastic.errors import ConfigError
from slurm_elastic.resources import templates_dir


def render_sbatch(config: ElasticConfig, config_path: str) -> str:
    """The batch script for ``config`` (``config_path`` as the script should name it)."""
    if not config.job.trainer_command:
        raise ConfigError(f"{config_path}: job.trainer_command is empty: name the trainer to run")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    return env.get_template("elastic_rl.sbatch.j2").render(
        job=config.job,
        config_path=shlex.quote(config_path),
        trainer_command=shlex.join(config.job.trainer_command),
        drain_timeout_s=f"{config.workers.drain_timeout_s:g}",
    )
