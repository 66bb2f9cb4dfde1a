"""``slurm-elastic render --config elastic.toml > job.sbatch``."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path),
              help="The job's elastic.toml.")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="Write here instead of stdout.")
def render(config_path: Path, output: Path | None) -> None:
    """Write a batch script that runs the controller, the trainer and elastic workers."""
    from slurm_elastic.controller.config import load_config
    from slurm_elastic.render import render_sbatch

    text = render_sbatch(load_config(config_path), str(config_path))
    if output is None:
        click.echo(text, nl=False)
    else:
        output.write_text(text)
        output.chmod(0o755)
