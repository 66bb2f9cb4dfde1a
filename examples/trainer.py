"""The example's trainer: pulls batches, takes a policy-gradient step, publishes the new version.

It prints the mean reward as it learns and, at the end, writes reward.csv and reward.png to
the job's state directory. ``--slow-steps A:B`` makes steps A..B slow (as a big update or an
evaluation would), so the buffer fills and the autoscaler scales the workers down.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy_rl import Policy, policy_gradient_step

from slurm_elastic.errors import ControllerStoppedError
from slurm_elastic.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=int(os.environ.get("EXAMPLE_STEPS", "60")))
    parser.add_argument("--step-s", type=float, default=0.3, help="compute time of a normal step")
    parser.add_argument("--slow-steps", default="", help="A:B: steps A..B take 8x longer")
    args = parser.parse_args()
    args.steps = int(os.environ.get("EXAMPLE_STEPS", args.steps))  # a shorter run for tests
    slow = range(*map(int, args.slow_steps.split(":"))) if args.slow_steps else range(0)
    trainer = Trainer.from_env()
    state_dir = trainer.state_dir or Path(".")
    policy_dir = state_dir / "policy"
    policy = Policy.load_latest(policy_dir)  # resume from the last saved version, if any
    if policy.version == 0:
        policy.save(policy_dir)
    trainer.publish_version(policy.version, recovered=policy.version > 0)
    history = []
    started = time.time()
    try:
        while policy.version < args.steps:
            batch = trainer.next_batch()
            if batch is None:
                break
            tokens = np.array([s["tokens"] for g in batch.groups for s in g["sequences"]])
            scores = np.array([s["score"] for g in batch.groups for s in g["sequences"]])
            time.sleep(args.step_s * (8 if policy.version in slow else 1))  # the "GPU" work
            policy = policy_gradient_step(policy, tokens, scores, group_size=batch.groups[0]["group_size"])
            policy.save(policy_dir)
            trainer.ack(batch)
            status = trainer.publish_version(policy.version)
            queue = trainer.status()  # retried through a controller restart, like the calls above
            history.append((policy.version, time.time() - started, float(scores.mean()),
                            queue["workers_by_state"]["ACTIVE"], queue["queue_size"]))
            print(f"step {policy.version:3d}  reward {scores.mean():.3f}  workers {history[-1][3]}  "
                  f"buffer {history[-1][4]:3d}  staleness capacity {status['staleness_capacity']}", flush=True)
    except ControllerStoppedError:  # `slurm-elastic stop`: the operator ended the run here
        print(f"the controller was stopped: training ends at step {policy.version}", flush=True)
    write_outputs(state_dir, history)
    trainer.close()


def write_outputs(state_dir: Path, history: list[tuple[int, float, float, int, int]]) -> None:
    lines = ["step,time_s,reward,active_workers,buffer_sequences"]
    lines += [",".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row) for row in history]
    (state_dir / "reward.csv").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    steps = [h[0] for h in history]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.plot(steps, [h[2] for h in history], color="tab:green")
    top.set_ylabel("mean reward")
    bottom.plot(steps, [h[3] for h in history], label="active workers", color="tab:blue")
    bottom.plot(steps, [h[4] / 32 for h in history], label="buffer (batches)", color="tab:orange")
    bottom.set_xlabel("policy version")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(state_dir / "reward.png", dpi=90)
    print(f"wrote {state_dir / 'reward.png'} and reward.csv", flush=True)


if __name__ == "__main__":
    main()
