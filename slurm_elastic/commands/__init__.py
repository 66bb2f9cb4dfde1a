"""Sub-commands of the CLI, one module each.

``COMMANDS`` maps each command's name to ``module:attribute``; ``cli.main`` imports a command's
module only when that command runs (or help lists them all), so ``slurm-elastic worker``, which
starts with every worker step, does not pay for the client, the simulator or the dev cluster.
"""

from __future__ import annotations

import importlib

import click

_JOBS = "slurm_elastic.commands.jobs"
_POOL = "slurm_elastic.commands.worker_pool"

COMMANDS: dict[str, str] = {
    "devcluster": "slurm_elastic.commands.devcluster:devcluster",
    "agent": "slurm_elastic.commands.agent:agent",
    "render": "slurm_elastic.commands.render:render",
    "controller": "slurm_elastic.commands.controller:controller",
    "worker": "slurm_elastic.commands.controller:worker",
    "burst-watch": "slurm_elastic.commands.controller:burst_watch",
    "simulate": "slurm_elastic.commands.simulate:simulate",
    "status": f"{_JOBS}:status",
    "scale": f"{_POOL}:scale",
    "pause": f"{_POOL}:pause",
    "resume": f"{_POOL}:resume",
    "wake-all": f"{_POOL}:wake_all",
    "drain": f"{_POOL}:drain",
    "cordon": f"{_POOL}:cordon",
    "uncordon": f"{_POOL}:uncordon",
    "wait-ready": f"{_JOBS}:wait_ready",
    "stop": f"{_JOBS}:stop",
}


def load_command(name: str) -> click.Command | None:
    """The command called ``name`` (its module imported now), or None for an unknown name."""
    target = COMMANDS.get(name)
    if target is None:
        return None
    module, attribute = target.split(":")
    command = getattr(importlib.import_module(module), attribute)
    if not isinstance(command, click.Command):
        raise TypeError(f"{target} is not a click command")
    return command
