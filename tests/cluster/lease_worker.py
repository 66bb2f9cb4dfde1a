"""A test worker that is admitted for one group of 4 sequences and then stays mid-rollout until
it is drained or killed: a killed step leaves its lease behind."""

import time

from slurm_elastic.worker import RolloutWorker

with RolloutWorker.from_env() as worker:
    worker.admit(4)
    with worker.rollout():
        while not worker.draining:
            time.sleep(0.1)
