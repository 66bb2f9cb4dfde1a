"""Serve the controller's API with a rollout queue (no Slurm needed) for bench/bench_ingest.py.

Served as the controller serves it (``ApiServer``: uvicorn in a thread of the process), with a
queue big enough for the benchmark's backlog. Runs until SIGTERM.

One route more than the controller has, for the bench only: ``POST /bench/empty`` empties the
queue the way a trainer does (every batch pulled and acknowledged, here in process), so the bench
can start each run with an empty queue, as it does Atropos' (``GET /reset_data``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from slurm_elastic.controller.app import create_controller_app, settle_heap
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.serve import ApiServer
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.slurm.cli_backend import SlurmCli


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fsync", default="always", choices=["always", "os", "off"])
    parser.add_argument("--dir", default="", help="state directory (default: a new one under /tmp, on disk here)")
    parser.add_argument("--batch-seqs", type=int, default=32, help="the trainer's batch (large: /bench/empty is quick)")
    args = parser.parse_args()
    state = Path(args.dir or tempfile.mkdtemp(prefix="se-ingest-"))
    queue = RolloutQueue(RolloutStore(state / "q.sqlite", fsync=args.fsync),
                         QueueConfig(batch_size=args.batch_seqs, capacity_seqs=10**8, capacity_bytes=10**11,
                                     max_staleness=10**6, max_concurrent=10**8))
    controller = Controller(parse_config({"agent": {"enabled": False}}), 1, SlurmCli(), state,
                            gpus_by_node={"node1": (0,)}, queue=queue)
    app = create_controller_app(controller, "bench-token", queue)

    @app.post("/bench/empty")  # behind the job token, like every route
    def empty() -> dict[str, int]:
        batches = 0
        while (batch := queue.pull()) is not None:
            queue.ack(batch[0])
            batches += 1
        return {"batches": batches, "queued_sequences": int(queue.stats()["queued_sequences"])}

    server = ApiServer(app, "127.0.0.1", args.port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    settle_heap()  # as run_controller does
    server.start()
    stop.wait()
    server.stop()
    queue.store.close()


if __name__ == "__main__":
    main()
