"""The ``Trainer`` helper against a controller restart while it holds batches (prefetching), a
controller that stays down past ``next_batch``'s timeout, and an ``Iterator`` that waits."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from slurm_elastic.controller.files import publish
from slurm_elastic.trainer import Trainer
from tests.unit.served_controller import ServedController

TOKEN = "hold-token"


def serve(state_dir: Path) -> ServedController:
    server = ServedController(state_dir, TOKEN, {"autoscaler": {"min_workers": 0}}, batch_size=2)
    publish(state_dir, server.url, 1)  # where a restarted controller says it listens
    return server


def submit(server: ServedController, n: int) -> None:

    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for i in range(n):
            group = {"id": f"g{i}", "worker_id": "0001", "policy_version": 0, "group_size": 1,
                     "sequences": [{"tokens": [1, 2], "score": 0.5}]}
            assert http.post("/rollouts", json=group).json() == {"accepted": True}


def test_a_prefetching_trainer_trains_on_no_batch_twice_across_a_controller_restart(tmp_path: Path) -> None:
    server = serve(tmp_path)
    submit(server, 6)
    trainer = Trainer(server.url, TOKEN, state_dir=tmp_path, poll_s=0.01)
    first, second = trainer.next_batch(timeout_s=10), trainer.next_batch(timeout_s=10)
    assert first is not None and second is not None
    server.close()  # the controller restarts (on another port) while the trainer holds both
    again = serve(tmp_path)
    third = trainer.next_batch(timeout_s=10)
    assert third is not None and third.batch_id not in (first.batch_id, second.batch_id)
    seen = [g["id"] for b in (first, second, third) for g in b.groups]
    assert sorted(seen) == [f"g{i}" for i in range(6)]  # each once
    for batch in (first, second, third):
        trainer.ack(batch)
    assert again.queue.stats()["delivered_sequences"] == 6
    trainer.close()
    again.close()


def test_next_batch_returns_none_at_its_timeout_while_the_controller_is_down(tmp_path: Path) -> None:
    server = serve(tmp_path)
    trainer = Trainer(server.url, TOKEN, poll_s=0.01)
    server.close()
    started = time.monotonic()
    assert trainer.next_batch(timeout_s=1.0) is None
    assert time.monotonic() - started < 10
    trainer.close()
