"""A rollout worker for the example: samples groups from the current policy, heavy-tailed timing.

Run by the controller as `slurm-elastic worker -- python examples/worker.py` on its own GPU.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_rl import Policy, rollout_time_s, sample_group, target_sequence

from slurm_elastic.worker import RolloutWorker

GROUP = int(os.environ.get("GROUP_SIZE", "8"))
SCALE_S = float(os.environ.get("ROLLOUT_SCALE_S", "0.4"))


def main() -> None:
    with RolloutWorker.from_env() as worker:
        policy_dir = Path(os.environ["SLURM_ELASTIC_STATE_DIR"]) / "policy"
        rng = np.random.default_rng(int(worker.ctx.worker_id) * 7919 + os.getpid())
        target = target_sequence()
        policy = Policy.load_latest(policy_dir)
        n = 0
        refused: dict[str, int] = {}  # by reason: "stale", "policy_version_ahead"
        while not worker.draining:
            if worker.admit(GROUP) < GROUP:  # the staleness gate said no (or we are draining)
                continue
            latest = Policy.load_latest(policy_dir)  # admit() waited while the trainer moved on: newest now
            if latest.version > policy.version:
                policy = latest
            with worker.rollout():  # busy: a drain lets this rollout finish first
                time.sleep(rollout_time_s(rng, SCALE_S))  # "generation"
                group = sample_group(policy, GROUP, rng, target)
            n += 1
            answer = worker.submit({
                "id": f"w{worker.ctx.worker_id}-{os.getpid()}-{n}", "policy_version": policy.version,
                "group_size": GROUP,
                "sequences": [{"tokens": t, "logprobs": lp, "score": s}
                              for t, lp, s in zip(group["tokens"], group["logprobs"], group["scores"], strict=True)],
            })
            if not answer.get("accepted"):
                reason = str(answer.get("reason", "refused"))
                refused[reason] = refused.get(reason, 0) + 1
        # what the store holds of this worker's: the groups it accepted (a log to audit the store by)
        not_stored = "".join(f", {count} {reason}" for reason, count in sorted(refused.items()))
        print(f"worker {worker.ctx.worker_id}: drained after {n} groups: {n - sum(refused.values())} stored"
              f"{not_stored or ', none refused'}", flush=True)


if __name__ == "__main__":
    main()
