"""``slurm-elastic simulate TRACE --out DIR``: replay a workload trace through the autoscaler."""

from __future__ import annotations

from pathlib import Path

import click

from slurm_elastic.commands.params import Whole
from slurm_elastic.errors import ConfigError
from slurm_elastic.sim.policies import POLICIES


@click.command()
@click.argument("trace_path", type=click.Path(path_type=Path))
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path),
              help="Directory for summary.json and timeline.png.")
@click.option("--policy", type=click.Choice(POLICIES), default="ours", show_default=True,
              help="The policy to run (ours, or a baseline of the benchmark).")
@click.option("--seed", type=Whole(min=0), default=None, help="RNG seed (default: the trace's).")
@click.option("--no-plot", is_flag=True, help="Skip timeline.png (no matplotlib needed).")
def simulate(trace_path: Path, out_dir: Path, policy: str, seed: int | None, no_plot: bool) -> None:
    """Replay a workload trace (TOML, see examples/traces/) with a simulated clock."""
    from slurm_elastic.sim.engine import simulate as run
    from slurm_elastic.sim.output import load_trace, summary_text, write_summary, write_timeline

    try:
        trace = load_trace(trace_path)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{trace_path}: not valid TOML: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    result = run(trace, policy, seed)
    try:
        write_summary(result, out_dir)
        if not no_plot:
            write_timeline(result, out_dir / "timeline.png")
    except OSError as exc:
        raise click.ClickException(f"cannot write the results to {out_dir}: {exc.strerror or exc}") from None
    click.echo(summary_text(result))
    click.echo(f"  wrote {out_dir / 'summary.json'}" + ("" if no_plot else f" and {out_dir / 'timeline.png'}"))
