"""The shape of a dev cluster and the Slurm configuration files its templates render for it."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import jinja2

from slurm_elastic.devcluster.cgroups import detect_cgroup_plugin
from slurm_elastic.devcluster.devices import nvidia_gpu_devices
from slurm_elastic.resources import templates_dir

SPEC_FILE = "devcluster.json"
CONFIG_FILES = ("slurm.conf", "gres.conf", "cgroup.conf")


def default_dir() -> Path:
    """``$XDG_CACHE_HOME/slurm-elastic/devcluster`` (``~/.cache/...`` by default)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "slurm-elastic" / "devcluster"


@dataclass(frozen=True)
class DevClusterSpec:
    """The shape of a dev cluster."""

    dir: Path = dataclasses.field(default_factory=default_dir)
    nodes: int = 2
    gpus_per_node: int = 4
    cpus_per_node: int = 16
    memory_per_node_mb: int = 16000
    def_mem_per_cpu_mb: int = 100
    ctld_port: int = 16817
    node_base_port: int = 16901
    partition: str = "debug"
    preempt_partition: str = "scavenger"  # its jobs are preempted (CANCEL after GraceTime) by the others
    urgent_partition: str = "urgent"  # a higher tier than both: tests preempt with it
    preempt_grace_s: int = 10
    cluster_name: str = "dev"
    first_job_id: int = 1  # a second cluster on this host numbers its jobs apart (tools look jobs up by id)
    node_prefix: str = "node"  # distinct prefixes keep two clusters' cgroups apart on one host
    prolog: str = ""
    epilog: str = ""
    slurm_prefix: str = ""  # a Slurm install (``PREFIX/sbin/slurmctld``, ``PREFIX/bin/srun``); "" uses PATH
    real_gpus: bool = False  # the first node's GPUs are the host's NVIDIA GPUs (the others' stay fake)

    def node_names(self) -> list[str]:
        return [f"{self.node_prefix}{i + 1}" for i in range(self.nodes)]

    def node_port(self, index: int) -> int:
        return self.node_base_port + index

    def to_json(self) -> dict[str, object]:
        data = dataclasses.asdict(self)
        data["dir"] = str(self.dir)
        return data

    @classmethod
    def from_json(cls, data: dict[str, object]) -> DevClusterSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        kwargs["dir"] = Path(str(kwargs.get("dir", default_dir())))
        return cls(**kwargs)  # type: ignore[arg-type]


def render_config_files(spec: DevClusterSpec, directory: Path, slurm_version: tuple[int, int],
                        nodes: list[dict[str, object]] | None = None) -> dict[str, str]:
    """slurm.conf, gres.conf and cgroup.conf as the templates make them for ``spec`` rooted at ``directory``.

    ``nodes`` (name, port, GPU device paths) defaults to the device files' standard places (the
    host's NVIDIA GPUs on the first node with ``spec.real_gpus``).
    """
    if nodes is None:
        real = [str(path) for path in nvidia_gpu_devices()] if spec.real_gpus else []
        nodes = [{"name": name, "port": spec.node_port(index),
                  "gpus": real if real and index == 0
                  else [str(directory / "dev" / name / f"gpu{g}") for g in range(spec.gpus_per_node)]}
                 for index, name in enumerate(spec.node_names())]
    context = {
        **spec.to_json(),
        "dir": str(directory),
        "nodes": nodes,
        "cgroup_plugin": detect_cgroup_plugin(),
        "slurm_version": list(slurm_version),
    }
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir() / "devcluster")),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    return {name: env.get_template(f"{name}.j2").render(**context) for name in CONFIG_FILES}


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new file, never a part."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
