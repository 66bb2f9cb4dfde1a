"""Runs as a job step: writes its SLURM_* environment, then one line per signal it gets, to OUT.

usage: signal_probe.py OUT
"""

import json
import os
import signal
import sys
import time

out = open(sys.argv[1], "a", buffering=1)  # noqa: SIM115


def _record(signum: int, _frame: object) -> None:
    out.write(json.dumps({"signal": signal.Signals(signum).name, "t": time.time()}) + "\n")


for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
    signal.signal(signum, _record)
out.write(json.dumps({"env": {k: v for k, v in os.environ.items() if k.startswith("SLURM")}}) + "\n")
while True:
    time.sleep(0.1)
