"""A test worker written with the SDK. Odd worker ids stay idle, even ids are always mid-rollout."""

import json
import os
import time

from slurm_elastic.worker import RolloutWorker

log_path = os.environ.get("FAKE_WORKER_LOG", "/dev/null")
rollout_s = float(os.environ.get("ROLLOUT_S", "0.5"))


def event(worker_id: str, kind: str, **extra: object) -> None:
    with open(log_path, "a") as f:
        f.write(json.dumps({"worker": worker_id, "event": kind, "t": time.time(), **extra}) + "\n")


with RolloutWorker.from_env() as worker:
    wid = worker.ctx.worker_id
    idle = int(wid) % 2 == 1
    event(wid, "start", idle=idle)
    n = 0
    while not worker.draining:
        if idle:
            time.sleep(0.1)
            continue
        n += 1
        with worker.rollout():
            event(wid, "rollout_begin", n=n)
            time.sleep(rollout_s)
            event(wid, "rollout_end", n=n)
    event(wid, "drained", rollouts=worker.rollouts)
