"""``slurm-elastic render elastic.toml > job.sbatch`` (or ``--config elastic.toml``)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("config_arg", required=False, type=click.Path(path_type=Path), metavar="[CONFIG]")
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None,
              help="The job's elastic.toml (or give it as the argument).")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="Write here instead of stdout.")
def render(config_arg: Path | None, config_path: Path | None, output: Path | None) -> None:
    """Write a batch script that runs the controller, the trainer and elastic workers."""
    from slurm_elastic.controller.config import load_config
    from slurm_elastic.render import render_sbatch

    if config_arg is not None and config_path is not None and config_arg != config_path:
        raise click.UsageError(f"two configs named ({config_arg} and --config {config_path}): name one")
    config_path = config_path or config_arg
    if config_path is None:
        raise click.UsageError("name the job's config: slurm-elastic render elastic.toml (or --config elastic.toml)")
    text = render_sbatch(load_config(config_path), str(config_path))
    if output is None:
        click.echo(text, nl=False)
    else:
        try:
            output.write_text(text)
            output.chmod(0o755)
        except OSError as exc:
            raise click.ClickException(f"cannot write the batch script to {output}: {exc.strerror or exc}") from None
