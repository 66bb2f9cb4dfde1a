"""The controller's API served in this process as the controller serves it: ``ApiServer`` over the
real app, a real controller object and a real rollout store on disk. (``served_api`` does the same
in a process of its own.)"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slurm_elastic.controller.app import create_controller_app, keep_alive_s
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.serve import ApiServer
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.slurm.cli_backend import SlurmCli


class ServedController:
    """A started server; ``close()`` stops it and closes the store."""

    def __init__(self, state_dir: Path, token: str, config: Mapping[str, Any] | None = None, *,
                 batch_size: int = 8, capacity_seqs: int = 4096, gpus: tuple[int, ...] = (0, 1),
                 fsync: str = "off", body_timeout_s: float | None = None) -> None:
        self.queue = RolloutQueue(RolloutStore(state_dir / "q.sqlite", fsync=fsync),
                                  QueueConfig(batch_size=batch_size, capacity_seqs=capacity_seqs))
        parsed = parse_config({"agent": {"enabled": False}, **(config or {})})
        self.controller = Controller(parsed, 1, SlurmCli(timeout_s=5), state_dir, gpus_by_node={"node1": gpus},
                                     queue=self.queue)
        app = create_controller_app(self.controller, token, self.queue)
        if body_timeout_s is not None:
            app.guard.body_timeout_s = body_timeout_s  # type: ignore[attr-defined]
        self.server = ApiServer(app, "127.0.0.1", keep_alive_s=keep_alive_s(parsed))  # as the controller serves it
        self.server.start()
        self.url = self.server.url

    def launched(self, *worker_ids: str) -> ServedController:
        """Let ``worker_ids`` hold admission leases and register, as steps of those names in Slurm's
        listing would (the controller refuses ids it did not launch)."""
        self.controller.state.listed_worker_ids |= frozenset(worker_ids)
        return self

    def close(self) -> None:
        self.server.stop()
        self.queue.store.close()
