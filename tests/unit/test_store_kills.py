"""kill -9 of a real writer (``store_writer.py``: a store and a queue that submit, pull,
acknowledge and publish versions) at random points, seeded, then the store opened again: every
group it was told was stored is there exactly once, none is in two batches, no batch
acknowledged comes back, and the policy version is at least the last one published."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore

WRITER = Path(__file__).with_name("store_writer.py")
ROOT = str(Path(__file__).resolve().parents[2])
KILLS = int(os.environ.get("STORE_KILLS", "5"))  # per seed; a longer fuzz: STORE_KILLS=200


class Seen:
    """What the writers printed, across all their runs."""

    def __init__(self) -> None:
        self.accepted: dict[str, int] = {}  # id -> run that was told it was stored
        self.batches: dict[str, set[str]] = {}  # batch id -> its groups when first handed out
        self.acked: set[str] = set()
        self.version = 0
        self.in_flight: list[str] = []  # ids whose submit had started, answer not seen
        self.maybe: set[str] = set()  # ids ever in flight: stored or not

    def read(self, run: int, words: list[str]) -> None:
        kind, rest = words[0], words[1:]
        if kind == "S":
            self.in_flight.append(rest[0])
            self.maybe.add(rest[0])
        elif kind in "AD":
            if rest[0] in self.in_flight:
                self.in_flight.remove(rest[0])
            if kind == "A":
                assert rest[0] not in self.accepted, f"{rest[0]} stored twice"
                self.accepted[rest[0]] = run
            else:
                assert rest[0] in self.accepted or rest[0] in self.maybe, f"{rest[0]} a retry of what?"
        elif kind == "P":
            batch_id, groups = rest[0], set(rest[1:])
            assert batch_id not in self.acked, f"batch {batch_id} handed out again after its ack"
            if batch_id in self.batches:
                assert groups <= self.batches[batch_id], f"batch {batch_id} came back with other groups"
            else:
                for other, held in self.batches.items():
                    assert not groups & held, f"{groups & held} in batches {other} and {batch_id}"
                self.batches[batch_id] = groups
            assert groups <= set(self.accepted) | self.maybe, f"batch {batch_id} holds groups never submitted"
        elif kind == "K":
            self.acked.add(rest[0])
        elif kind in "VR":
            if kind == "R":
                assert int(rest[0]) >= self.version, f"opened at version {rest[0]}, {self.version} was published"
            self.version = max(self.version, int(rest[0]))


def run_writer(store: Path, run: int, seed: int, fsync: str, resend: list[str], stop_after: int,
               whole_group: bool, seen: Seen) -> None:
    """Start a writer, read ``stop_after`` of its lines, kill it (its process group: the syncer
    too, when ``whole_group``)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    child = subprocess.Popen([sys.executable, str(WRITER), str(store), str(run), str(seed), fsync, *resend],
                             stdout=subprocess.PIPE, env=env, start_new_session=True)
    assert child.stdout is not None
    try:
        for _ in range(stop_after):
            line = child.stdout.readline()
            if not line:
                break
            seen.read(run, line.decode().split())
    finally:
        if whole_group:
            os.killpg(child.pid, signal.SIGKILL)
        else:
            child.kill()
        for line in child.stdout.read().splitlines(keepends=True):  # printed before the kill landed
            if line.endswith(b"\n"):
                seen.read(run, line.decode().split())
        child.wait()
    assert child.returncode == -signal.SIGKILL, f"the writer exited {child.returncode} before it was killed"


@pytest.mark.parametrize("seed,fsync", [(1, "always"), (2, "os")])
def test_kill_9_of_a_writer_at_random_points_loses_and_repeats_nothing(tmp_path: Path, seed: int,
                                                                        fsync: str) -> None:
    rng = random.Random(seed)
    store_path = tmp_path / "q.sqlite"
    seen = Seen()
    for run in range(KILLS):
        resend = [*seen.in_flight, *rng.sample(sorted(seen.accepted), min(2, len(seen.accepted)))]
        seen.in_flight = []
        run_writer(store_path, run, rng.randrange(1 << 30), fsync, resend, rng.randrange(2, 60),
                   rng.random() < 0.5, seen)
    store = RolloutStore(store_path, lock_wait_s=60)
    q = RolloutQueue(store, QueueConfig(batch_size=8, capacity_seqs=100_000, max_staleness=10_000))
    seen.read(KILLS, ["R", str(q.staleness.version)])
    with store._index.reading() as db:
        state = dict(db.execute("SELECT id, state FROM groups"))
    assert not {g for g in seen.accepted if state.get(g) not in ("queued", "handed", "delivered")}
    assert store.lost() == [] and q.stats()["dropped_stale_sequences"] == 0
    delivered = {g for g, s in state.items() if s == "delivered"}
    assert set().union(*(seen.batches[b] for b in seen.acked)) <= delivered
    q.trainer_restarted()
    while (batch := q.pull()) is not None:  # the rest, batch by batch: nothing delivered comes again
        seen.read(KILLS, ["P", batch[0], *(json.loads(p)["id"] for p in batch[1])])
        assert q.ack(batch[0])
        seen.acked.add(batch[0])
    store.close()
