"""The ``slurm-elastic`` command line: a thin click layer over the library."""

from __future__ import annotations

import logging
import sys

import click

from slurm_elastic import __version__
from slurm_elastic.commands import COMMANDS, load_command
from slurm_elastic.errors import EXIT_CONFIG, ConfigError, SlurmElasticError


class _Group(click.Group):
    """Loads each sub-command when it is used (see ``slurm_elastic.commands``) and turns our own
    errors into a one-line message and exit code 1 (78 for a configuration error), not a traceback."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return load_command(cmd_name)

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except SlurmElasticError as exc:
            click.echo(f"slurm-elastic: error: {exc}", err=True)
            sys.exit(EXIT_CONFIG if isinstance(exc, ConfigError) else 1)
        except click.UsageError:
            raise  # click's own usage message and exit 2
        except click.ClickException as exc:  # a command's own failure: said as ours are
            click.echo(f"slurm-elastic: error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="slurm-elastic")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def main(verbose: int) -> None:
    """Elastic RL rollout workers as GPU-pinned Slurm job steps."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

