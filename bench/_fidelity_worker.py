"""A trace-driven rollout worker for bench/bench_sim_fidelity.py, written with the SDK.

It loads its model once (sleeps the trace's ``warmup_s``), then loops: admit a group of the
trace's ``group_size``, sleep a rollout time drawn from the trace's distribution times the
phase's ``rollout_scale`` at that moment (the run's t = 0 is read from ``FIDELITY_T0_FILE``), and
submit the group stamped with the trainer's version at its admission (``FIDELITY_VERSION_FILE``).

usage (as the controller's worker command): _fidelity_worker.py TRACE.toml
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

from slurm_elastic.sim.output import load_trace
from slurm_elastic.worker import RolloutWorker


def _read_float(path: Path, default: float) -> float:
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return default


def main() -> None:
    trace = load_trace(Path(sys.argv[1]))
    t0_file, version_file = Path(os.environ["FIDELITY_T0_FILE"]), Path(os.environ["FIDELITY_VERSION_FILE"])
    group = trace.queue.group_size
    with RolloutWorker.from_env() as worker:
        rng = random.Random(int(worker.ctx.worker_id) * 7919 + os.getpid())
        time.sleep(trace.cluster.warmup_s)  # the model load
        n = 0
        while not worker.draining:
            if worker.admit(group) < group:  # a drain ended the wait
                continue
            version = int(_read_float(version_file, 0.0))
            t_s = time.time() - _read_float(t0_file, time.time())
            with worker.rollout():
                time.sleep(trace.rollout.sample_s(rng) * trace.phase_at(t_s).rollout_scale)
            n += 1
            worker.submit({"id": f"w{worker.ctx.worker_id}-{os.getpid()}-{n}", "policy_version": version,
                           "group_size": group,
                           "sequences": [{"tokens": [1, 2, 3], "score": 0.0} for _ in range(group)]})


if __name__ == "__main__":
    main()
