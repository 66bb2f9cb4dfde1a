"""A rollout writer for the kill tests (``test_store_kills.py``): a store and a queue in a
process of its own that submits groups, pulls, acknowledges and publishes versions at random
(seeded), and prints each step once it returned (``A id``: accepted, ``D id``: a retry of one
stored before, ``P batch id...``, ``K batch``, ``V version``, ``R version``: opened)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore


def body(group_id: str, rng: random.Random) -> bytes:
    return json.dumps({"id": group_id, "pad": "x" * rng.randrange(10, 3000)}).encode()


def main(path: str, run: int, seed: int, fsync: str, resend: list[str]) -> None:
    rng = random.Random(seed)
    store = RolloutStore(Path(path), fsync=fsync, segment_bytes=8192, lock_wait_s=60)
    q = RolloutQueue(store, QueueConfig(batch_size=8, capacity_seqs=100_000, max_staleness=10_000))
    session, _n = q.trainer_restarted()

    def say(*words: object) -> None:
        print(*words, flush=True)

    say("R", q.staleness.version)
    for group_id in resend:  # groups the last run may or may not have stored
        stored = q.submit(group_id, "w", 4, q.staleness.version, body(group_id, rng))
        say("A" if stored else "D", group_id)
    held: list[str] = []
    i = 0
    while True:
        r = rng.random()
        if r < 0.6:
            group_id = f"{run}-{i}"
            i += 1
            say("S", group_id)  # about to submit: the parent resends it after a kill
            stored = q.submit(group_id, "w", rng.choice([1, 2, 4]), q.staleness.version, body(group_id, rng))
            say("A" if stored else "D", group_id)
        elif r < 0.8:
            batch = q.pull(session=session)
            if batch is not None:
                held.append(batch[0])
                say("P", batch[0], *(json.loads(p)["id"] for p in batch[1]))
        elif r < 0.95 and held:
            batch_id = held.pop(rng.randrange(len(held)))
            q.ack(batch_id, session)
            say("K", batch_id)
        elif r >= 0.95:
            version = q.staleness.version + 1
            q.set_version(version, session=session)
            say("V", version)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:])
