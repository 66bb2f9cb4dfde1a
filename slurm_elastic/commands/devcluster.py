"""``slurm-elastic devcluster``: a local multi-node Slurm cluster with fake GPUs."""

from __future__ import annotations

import click


@click.group()
def devcluster() -> None:
    """A local Slurm cluster on this host (several slurmd nodes, fake GPUs as GRES)."""
