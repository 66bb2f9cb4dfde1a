"""The ``slurm-elastic`` command line: a thin click layer over the library."""

from __future__ import annotations

import logging
import sys

import click

from slurm_elastic import __version__
from slurm_elastic.errors import SlurmElasticError


class _Group(click.Group):
    """Turns our own errors into a one-line message and exit code 1, not a traceback."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except SlurmElasticError as exc:
            click.echo(f"slurm-elastic: error: {exc}", err=True)
            sys.exit(1)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="slurm-elastic")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def main(verbose: int) -> None:
    """Elastic RL rollout workers as GPU-pinned Slurm job steps."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _register() -> None:
    from slurm_elastic.commands import COMMANDS

    for command in COMMANDS:
        main.add_command(command)


_register()
