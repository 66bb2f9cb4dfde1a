"""A drain-aware test worker: "rollouts" take ROLLOUT_S; on the drain signal it finishes the
current one, records it, and exits 0. With IGNORE_DRAIN=1 it ignores the signal; with
CRASH=1 it exits 3 at once. Appends events to $FAKE_WORKER_LOG (one JSON per line)."""

import json
import os
import signal
import sys
import time

log_path = os.environ.get("FAKE_WORKER_LOG", "/dev/null")
worker_id = os.environ.get("SLURM_ELASTIC_WORKER_ID", "?")
rollout_s = float(os.environ.get("ROLLOUT_S", "0.5"))
draining = False


def event(kind: str, **extra: object) -> None:
    with open(log_path, "a") as f:
        f.write(json.dumps({"worker": worker_id, "event": kind, "t": time.time(), **extra}) + "\n")


def on_drain(_signum: int, _frame: object) -> None:
    global draining
    draining = True


if os.environ.get("CRASH") == "1":
    event("crash")
    sys.exit(3)
signal.signal(signal.SIGUSR1, signal.SIG_IGN if os.environ.get("IGNORE_DRAIN") == "1" else on_drain)
node = os.environ.get("SLURMD_NODENAME", "")
openable = []
gpu_dir = os.environ.get("FAKE_GPU_DIR", "")
if gpu_dir and os.path.isdir(os.path.join(gpu_dir, node)):
    for name in sorted(os.listdir(os.path.join(gpu_dir, node))):
        try:
            os.close(os.open(os.path.join(gpu_dir, node, name), os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY))
            openable.append(int(name.removeprefix("gpu")))
        except OSError:
            pass
event("start", gpus=os.environ.get("SLURM_STEP_GPUS"), node=node, openable=openable)
n = 0
while not draining:
    n += 1
    event("rollout_begin", n=n)
    time.sleep(rollout_s)
    event("rollout_end", n=n)
event("drained", rollouts=n)
sys.exit(0)
