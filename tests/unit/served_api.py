"""The controller's API served as the controller serves it (``ApiServer`` over the real app, a real
controller object and a real rollout store on disk), in a process of its own so that tests can
measure its memory and lower its open-files limit. Prints its URL, then serves until stdin closes.

    python -m tests.unit.served_api STATE_DIR TOKEN [--nofile N] [--head-timeout-s S] [--write-timeout-s S]
                                              [--min-send-rate-bytes-per-s R] [--batch-size B]
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

from slurm_elastic.controller.app import create_controller_app, keep_alive_s
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.serve import ApiServer
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.slurm.cli_backend import SlurmCli


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("state_dir", type=Path)
    parser.add_argument("token")
    parser.add_argument("--nofile", type=int, default=0, help="soft and hard RLIMIT_NOFILE (0: as inherited)")
    parser.add_argument("--head-timeout-s", type=float, default=None)
    parser.add_argument("--write-timeout-s", type=float, default=None)
    parser.add_argument("--min-send-rate-bytes-per-s", type=float, default=None)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--keep-alive-s", type=int, default=None, help="default: the controller's (20 s)")
    args = parser.parse_args()
    if args.nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))
    queue = RolloutQueue(RolloutStore(args.state_dir / "q.sqlite", fsync="off"),
                         QueueConfig(batch_size=args.batch_size, capacity_seqs=4096))
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    controller = Controller(config, 1, SlurmCli(timeout_s=5), args.state_dir, gpus_by_node={"node1": (0, 1, 2, 3)},
                            queue=queue)
    options = {name: value for name, value in (("head_timeout_s", args.head_timeout_s),
                                               ("write_timeout_s", args.write_timeout_s),
                                               ("min_send_rate_bytes_per_s", args.min_send_rate_bytes_per_s))
               if value is not None}
    server = ApiServer(create_controller_app(controller, args.token, queue), "127.0.0.1",
                       keep_alive_s=args.keep_alive_s or keep_alive_s(config), **options)
    server.start()
    print(server.url, flush=True)
    sys.stdin.read()  # until the test closes our stdin
    server.stop()
    queue.store.close()


if __name__ == "__main__":
    main()
