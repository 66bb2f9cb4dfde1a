"""docs/status.md names every field the controller's status, its workers, its cordons and the queue's numbers carry (a real
controller and a real rollout store on disk)."""

from __future__ import annotations

import re
from pathlib import Path

from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.lifecycle import Worker
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.slurm.cli_backend import SlurmCli

DOC = Path(__file__).resolve().parents[2] / "docs" / "status.md"


def documented() -> set[str]:
    """The names in backquotes in the first column of the doc's tables."""
    names: set[str] = set()
    for line in DOC.read_text().splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    return names


def row_names(field: str) -> set[str]:
    """The names listed in the first backquoted run of ``field``'s row: ``a, b, c`` or ``{a, b}``."""
    cell = DOC.read_text().split(f"| `{field}` |")[1].split("\n")[0].split("|")[1]
    return set(re.findall(r"[a-z_]+", re.findall(r"`([^`]*)`", cell)[0]))


def test_every_field_of_the_controller_and_the_queue_is_documented(tmp_path: Path) -> None:
    queue = RolloutQueue(RolloutStore(tmp_path / "q.sqlite", fsync="off"), QueueConfig(batch_size=8, capacity_seqs=64))
    try:
        for kind in ("rollout", "server"):
            controller = Controller(parse_config({"agent": {"enabled": False}, "workers": {"kind": kind}}), 1,
                                    SlurmCli(timeout_s=5), tmp_path / kind, gpus_by_node={"node1": (0, 1)}, queue=queue)
            controller.state.workers["0001"] = Worker("0001", node="node1", gpus=(0,))
            controller.cordon("node1", 1, "doc test")
            status = controller.status()
            assert set(status) - documented() == set(), kind
            assert set(status["workers"][0]) == row_names("workers"), kind
            assert set(status["cordoned_gpus"][0]) == row_names("cordoned_gpus"), kind
            assert set(status["queue"]) - documented() == set()
            if kind == "server":
                servers = DOC.read_text().split("| `servers` |")[1].split("\n")[0]
                assert {f for f in status["servers"] if f"`{f}`" not in servers} == set()
    finally:
        queue.store.close()
