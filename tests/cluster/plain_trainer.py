"""Runs as the trainer step: appends the time to OUT every 0.2 s and handles no signal (a signal
whose default action ends a process ends it).

usage: plain_trainer.py OUT
"""

import sys
import time

with open(sys.argv[1], "a", buffering=1) as out:
    while True:
        out.write(f"{time.time():.3f}\n")
        time.sleep(0.2)
