"""The chaos soak's rollout worker (SDK): submits small groups with unique ids and keeps its own
record, one JSON line per event in ``LOG_DIR/<worker>-<pid>.jsonl``:

- ``start``: worker id, pid, node, ``SLURM_STEP_GPUS``, step id, and the process creation time
  (as close to the controller's "run" answer as the worker can see);
- ``submit``: a group id about to be sent; ``acked``: the controller answered 2xx for it.

Usage (as the controller's worker command): ``python chaos_worker.py LOG_DIR``.
"""

import json
import os
import sys
import time
from pathlib import Path

import psutil

from slurm_elastic.worker import RolloutWorker

GROUP_SIZE = int(os.environ.get("CHAOS_GROUP_SIZE", "2"))
ROLLOUT_S = float(os.environ.get("CHAOS_ROLLOUT_S", "0.3"))


def main(log_dir: Path) -> None:
    with RolloutWorker.from_env() as worker:
        wid, pid = worker.ctx.worker_id, os.getpid()
        log = (log_dir / f"{wid}-{pid}.jsonl").open("a", buffering=1)

        def event(kind: str, **extra: object) -> None:
            log.write(json.dumps({"event": kind, "worker": wid, "pid": pid, "t": time.time(), **extra}) + "\n")

        event("start", ppid=os.getppid(), node=worker.ctx.node, gpus=list(worker.ctx.gpus),
              step_id=worker.ctx.step_id, proc_start_t=psutil.Process(pid).create_time())
        n = 0
        while not worker.draining:
            with worker.rollout():
                time.sleep(ROLLOUT_S)
            n += 1
            gid = f"{wid}-{pid}-{n}"
            event("submit", id=gid)
            worker.submit({"id": gid, "policy_version": 0, "group_size": GROUP_SIZE,
                           "sequences": [{"tokens": [1, 2, 3], "score": 0.5} for _ in range(GROUP_SIZE)]})
            event("acked", id=gid)
        event("drained", groups=n)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
