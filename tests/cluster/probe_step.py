"""Runs inside a job step: records where it runs and which fake GPUs it can open, then waits.

usage: probe_step.py OUT_JSON DEV_DIR [hold_s]
On SIGUSR1 it appends "USR1" to OUT_JSON.signals and exits 0; it touches OUT_JSON.alive every 0.2 s.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

out, dev_dir = Path(sys.argv[1]), Path(sys.argv[2])
hold_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
node = os.environ.get("SLURMD_NODENAME", "")
openable = []
for dev in sorted((dev_dir / node).glob("gpu*")):
    try:
        fd = os.open(dev, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        os.close(fd)
        openable.append(int(dev.name.removeprefix("gpu")))
    except OSError:
        pass
drained = False


def _on_usr1(_signum: int, _frame: object) -> None:
    global drained
    drained = True


signal.signal(signal.SIGUSR1, _on_usr1)
record = {
    "node": node,
    "step_id": os.environ.get("SLURM_STEP_ID"),
    "step_gpus": os.environ.get("SLURM_STEP_GPUS"),
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "openable": openable,
    "pid": os.getpid(),
}
tmp = out.with_suffix(".tmp")
tmp.write_text(json.dumps(record))
os.replace(tmp, out)
deadline = time.monotonic() + hold_s
while time.monotonic() < deadline and not drained:
    Path(str(out) + ".alive").write_text(str(time.time()))
    time.sleep(0.2)
if drained:
    with open(str(out) + ".signals", "a") as f:
        f.write("USR1\n")
