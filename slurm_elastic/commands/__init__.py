"""Sub-commands of the CLI, one module each; ``COMMANDS`` lists what ``cli.main`` registers."""

from __future__ import annotations

import click

from slurm_elastic.commands.agent import agent
from slurm_elastic.commands.controller import burst_watch, controller, worker
from slurm_elastic.commands.devcluster import devcluster
from slurm_elastic.commands.jobs import JOB_COMMANDS
from slurm_elastic.commands.render import render
from slurm_elastic.commands.simulate import simulate

COMMANDS: list[click.Command] = [devcluster, agent, render, controller, worker, burst_watch, simulate, *JOB_COMMANDS]
