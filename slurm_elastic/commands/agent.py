"""``slurm-elastic agent``: the per-node GPU health agent (one ``srun --overlap`` step per node)."""

from __future__ import annotations

import json
import sys
import time

import click

from slurm_elastic.commands.params import Seconds, Whole
from slurm_elastic.core.defaults import AGENT_INTERVAL_S, AGENT_MAX_BACKOFF_S
from slurm_elastic.core.limits import MAX_GPUS
from slurm_elastic.errors import ConfigError


@click.command()
@click.option(
    "--controller-url", envvar="SLURM_ELASTIC_CONTROLLER_URL", help="Controller base URL."
)
@click.option(
    "--token-file",
    envvar="SLURM_ELASTIC_TOKEN_FILE",
    type=click.Path(dir_okay=False),
    help="File holding the bearer token for the controller.",
)
@click.option(
    "--source",
    type=click.Choice(["nvml", "inject", "auto"]),
    default="auto",
    show_default=True,
    help="auto: NVML; the injection file only on a node without an NVIDIA driver (where NVML fails to start).",
)
@click.option(
    "--inject-file",
    envvar="SLURM_ELASTIC_INJECT_FILE",
    type=click.Path(dir_okay=False),
    help="Fault-injection file (TOML or JSON), re-read every sample.",
)
@click.option("--gpus", "fake_gpus", type=Whole(min=0, max=MAX_GPUS), help="Fake GPU count (inject).")
@click.option("--node", help="Node name (default: SLURMD_NODENAME or the short hostname).")
@click.option("--interval-s", type=Seconds(0.1), default=AGENT_INTERVAL_S, show_default=True)
@click.option("--max-backoff-s", type=Seconds(0.1), default=AGENT_MAX_BACKOFF_S, show_default=True)
@click.option("--once", is_flag=True, help="Sample and post once; exit 1 if not delivered.")
@click.option("--print", "print_only", is_flag=True, help="Print one report as JSON; post nothing.")
def agent(
    controller_url: str | None,
    token_file: str | None,
    source: str,
    inject_file: str | None,
    fake_gpus: int | None,
    node: str | None,
    interval_s: float,
    max_backoff_s: float,
    once: bool,
    print_only: bool,
) -> None:
    """Sample this node's GPUs and report them to the controller."""
    from slurm_elastic.client.wire import report_json
    from slurm_elastic.gpu.agent import Agent, ReportPoster, build_report, make_source, node_name

    node = node or node_name()
    src = make_source(source, node, inject_file, fake_gpus)  # type: ignore[arg-type]
    if print_only:
        try:
            report = build_report(src, node, time.time())
        finally:
            src.close()
        click.echo(json.dumps(report_json(report), indent=2))
        return
    if not controller_url:
        raise ConfigError("--controller-url (or SLURM_ELASTIC_CONTROLLER_URL) is required")
    if not token_file:
        raise ConfigError("--token-file (or SLURM_ELASTIC_TOKEN_FILE) is required")
    poster = ReportPoster(controller_url, token_file)
    poster.token()  # fail fast on a missing token file
    loop = Agent(src, poster, node, interval_s=interval_s, max_backoff_s=max_backoff_s)
    if once:
        try:
            ok = loop.run_once()
        finally:
            src.close()
            poster.close()
        sys.exit(0 if ok else 1)
    loop.install_signal_handlers()
    sys.exit(loop.run())
