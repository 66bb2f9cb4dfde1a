"""The trainer's step, as the real queue measures it from pulls and acknowledgements: calls that
are not a step's end (a retried pull, a batch handed out again to a re-registered trainer and
acknowledged at once, a pull ahead) never read as a step of a few milliseconds, which the
speed-up resize would take for a trainer that sped up a hundredfold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def filled(tmp: Path, clock: Clock, n_groups: int = 12) -> RolloutQueue:
    q = RolloutQueue(RolloutStore(tmp / "q.sqlite", fsync="off"), QueueConfig(batch_size=8, capacity_seqs=100),
                     clock=clock)
    for i in range(n_groups):
        assert q.submit(f"g{i}", "0001", 4, 0, json.dumps({"id": f"g{i}"}).encode())
    return q


def latest_step_s(q: RolloutQueue) -> float | None:
    snapshot = q.snapshot()
    assert snapshot is not None
    return snapshot.trainer_latest_step_s


def one_step(q: RolloutQueue, clock: Clock, pull_id: str, step_s: float = 10.0) -> str:
    batch = q.pull(pull_id)
    assert batch is not None
    clock.now_s += step_s
    assert q.ack(batch[0])
    return batch[0]


def test_a_retried_pull_and_a_batch_a_new_trainer_acknowledges_at_once_are_no_steps(tmp_path: Path) -> None:
    clock = Clock()
    q = filled(tmp_path, clock)
    one_step(q, clock, "p1")
    one_step(q, clock, "p2")  # its ask ends the first step: 10 s
    assert latest_step_s(q) == pytest.approx(10.0, abs=0.01)
    held = q.pull("p3")
    clock.now_s += 0.001
    assert q.pull("p3") == held  # the answer was lost: the retry is no new ask
    clock.now_s += 10.0
    assert held is not None and q.ack(held[0])
    assert q.pull("p4") is not None and latest_step_s(q) == pytest.approx(10.0, abs=0.01)  # not 1 ms
    q.trainer_restarted()  # a trainer that had consumed p4's batch registers again
    clock.now_s += 1.0
    again = q.pull("p5")
    assert again is not None
    clock.now_s += 0.001
    assert q.ack(again[0])  # acknowledged at once: it was consumed before
    assert q.pull("p6") is not None and latest_step_s(q) == pytest.approx(10.0, abs=0.01)


def test_a_trainer_that_pulls_ahead_while_starving_is_measured_from_its_acknowledgements(tmp_path: Path) -> None:
    clock = Clock()
    q = filled(tmp_path, clock, n_groups=2)  # one batch queued: the pull ahead waits
    first = q.pull("p1")
    assert first is not None
    clock.now_s += 0.001
    assert q.pull("p2") is None  # asked for the next at once, and it computes the first meanwhile
    clock.now_s += 10.0
    assert q.ack(first[0])
    clock.now_s += 5.0  # then it waits
    for i in (2, 3):
        assert q.submit(f"g{i}", "0001", 4, 0, json.dumps({"id": f"g{i}"}).encode())
    assert q.pull("p2") is not None
    assert latest_step_s(q) == pytest.approx(10.0, abs=0.01)
    assert q.stats()["trainer_wait_fraction"] > 0.3  # the 5 s wait, not the 10 s of compute


def test_a_trainer_that_pulls_four_batches_for_one_update_is_measured_per_batch(tmp_path: Path) -> None:
    clock = Clock()
    q = filled(tmp_path, clock, n_groups=24)
    for round_ in range(2):
        batches = [q.pull(f"p{round_}-{i}") for i in range(4)]  # one update over four batches
        clock.now_s += 10.0
        for batch in batches:
            assert batch is not None and q.ack(batch[0])
    assert q.pull("p-next") is not None
    assert latest_step_s(q) == pytest.approx(2.5, abs=0.01)  # before: 10 s, a demand 4x too low


def test_an_acknowledgement_after_the_next_ask_ends_the_step_at_once(tmp_path: Path) -> None:
    clock = Clock()
    q = filled(tmp_path, clock, n_groups=2)
    batch = q.pull("p1")
    clock.now_s += 0.5
    assert batch is not None and q.pull("p2") is None  # asks for the next, then acknowledges
    assert q.ack(batch[0])
    assert q.stats()["trainer_step_s"] == pytest.approx(0.5)  # measured now, not at a later ask
