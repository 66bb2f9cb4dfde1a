"""``slurm-elastic devcluster up|down|status|env``: a local multi-node Slurm cluster with fake GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import click

from slurm_elastic.commands.params import Seconds, Whole
from slurm_elastic.core.limits import MAX_MEM_MB
from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec, default_dir

_dir_option = click.option(
    "--dir", "directory", type=click.Path(path_type=Path), default=None,
    help="Where the cluster's files live [default: ~/.cache/slurm-elastic/devcluster].",
)


def _progress(message: str) -> None:
    click.echo(f"  {message}", err=True)


@click.group()
def devcluster() -> None:
    """A local Slurm cluster on this host (several slurmd nodes, fake GPUs as GRES)."""


@devcluster.command()
@_dir_option
@click.option("--nodes", default=2, show_default=True, type=Whole(1, 64))
@click.option("--gpus-per-node", default=4, show_default=True, type=Whole(0, 16))
@click.option("--cpus-per-node", default=16, show_default=True, type=Whole(1, 1024))
@click.option("--memory-per-node-mb", default=16000, show_default=True, type=Whole(100, MAX_MEM_MB))
@click.option("--ctld-port", default=16817, show_default=True, type=Whole(1024, 65535))
@click.option("--node-base-port", default=16901, show_default=True, type=Whole(1024, 65535),
              help="node1 listens here, node2 on the next port, ...")
@click.option("--prolog", default="", help="Prolog= script for slurm.conf (admin hooks).")
@click.option("--epilog", default="", help="Epilog= script for slurm.conf (admin hooks).")
@click.option("--node-prefix", default="node", show_default=True,
              help="Node names are PREFIX1, PREFIX2, ...; give a second cluster on this host its own.")
@click.option("--cluster-name", default="dev", show_default=True, help="ClusterName= of slurm.conf.")
@click.option("--first-job-id", default=1, show_default=True, type=Whole(1, 60_000_000),
              help="FirstJobId= of slurm.conf; give a second cluster on this host job ids of its own.")
@click.option("--slurm-prefix", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Run the Slurm installed under this prefix (PREFIX/sbin/slurmctld, PREFIX/bin/srun) "
                   "instead of the one on PATH.")
@click.option("--real-gpus", is_flag=True,
              help="The first node's GPUs are this host's NVIDIA GPUs (/dev/nvidia0, ...), pinned to steps "
                   "by the device cgroup like the fake ones; the other nodes keep --gpus-per-node fake GPUs.")
@click.option("--wait-s", default=60.0, show_default=True, type=Seconds(0), help="How long to wait for nodes to be idle.")
def up(directory: Path | None, nodes: int, gpus_per_node: int, cpus_per_node: int,
       memory_per_node_mb: int, ctld_port: int, node_base_port: int, prolog: str, epilog: str,
       node_prefix: str, cluster_name: str, first_job_id: int, slurm_prefix: Path | None, real_gpus: bool,
       wait_s: float) -> None:
    """Start the cluster (idempotent) and wait until every node is idle."""
    spec = DevClusterSpec(
        dir=directory or default_dir(), nodes=nodes, gpus_per_node=gpus_per_node,
        cpus_per_node=cpus_per_node, memory_per_node_mb=memory_per_node_mb, ctld_port=ctld_port,
        node_base_port=node_base_port, prolog=prolog, epilog=epilog, node_prefix=node_prefix,
        cluster_name=cluster_name, first_job_id=first_job_id, slurm_prefix=str(slurm_prefix.resolve()) if slurm_prefix else "",
        real_gpus=real_gpus,
    )
    cluster = DevCluster(spec)
    cluster.up(wait_s=wait_s, progress=_progress)
    click.echo(cluster.env_lines(), nl=False)


@devcluster.command()
@_dir_option
def reconfigure(directory: Path | None) -> None:
    """Apply the templates' slurm.conf to a running cluster (restarts slurmctld; jobs keep running)."""
    cluster = DevCluster.at(directory or default_dir())
    changed = cluster.reconfigure(progress=_progress)
    click.echo("reconfigured" if changed else "unchanged")


@devcluster.command()
@_dir_option
def down(directory: Path | None) -> None:
    """Cancel the cluster's jobs and stop the daemons it started."""
    cluster = DevCluster.at(directory or default_dir())
    cluster.down(progress=_progress)


@devcluster.command()
@_dir_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(directory: Path | None, as_json: bool) -> None:
    """Show the daemons (pids) and node states."""
    info = DevCluster.at(directory or default_dir()).status()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"dir:        {info['dir']}")
    click.echo(f"SLURM_CONF: {info['slurm_conf']}")
    for daemon, pid in dict(info["daemons"]).items():  # type: ignore[call-overload]
        click.echo(f"  {daemon:<16} {'pid ' + str(pid) if pid else 'not running'}")
    for node, state in dict(info["nodes"]).items():  # type: ignore[call-overload]
        click.echo(f"  {node:<16} {state}")


@devcluster.command()
@_dir_option
def env(directory: Path | None) -> None:
    """Print `export SLURM_CONF=...` (and PATH for a --slurm-prefix cluster): eval "$(slurm-elastic devcluster env)"."""
    click.echo(DevCluster.at(directory or default_dir()).env_lines(), nl=False)
