"""A pull whose answer never reached the trainer: its retry (the same ``pull_id``) gets the same
batch, so the groups are not held until the trainer registers again; pulls with new ids, or
none, still get new batches, so a batch the trainer holds is never handed out twice."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slurm_elastic.client.control import ControlClient
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.trainer import Trainer
from tests.unit.served_controller import ServedController
from tests.unit.test_store_damage import flip_byte

TOKEN = "pull-token"


def make(tmp: Path) -> RolloutQueue:
    return RolloutQueue(RolloutStore(tmp / "q.sqlite", fsync="off"), QueueConfig(batch_size=8, capacity_seqs=100),
                        clock=lambda: 1000.0)


def filled(tmp: Path, n_groups: int) -> RolloutQueue:
    q = make(tmp)
    for i in range(n_groups):
        assert q.submit(f"g{i}", "0001", 4, 0, json.dumps({"id": f"g{i}", "pad": "x" * 64}).encode())
    return q


def ids(batch: tuple[str, list[bytes]] | None) -> list[str]:
    assert batch is not None
    return [json.loads(p)["id"] for p in batch[1]]


def test_a_retried_pull_gets_the_batch_its_first_try_got(tmp_path: Path) -> None:
    q = filled(tmp_path, 6)
    first = q.pull("p1")
    assert q.pull("p1") == first and ids(first) == ["g0", "g1"]  # the answer was lost: the retry
    second = q.pull("p2")
    assert ids(second) == ["g2", "g3"] and q.stats()["unacked_batches"] == 2  # a new pull: a new batch
    assert first is not None and q.ack(first[0])
    assert q.pull("p1") is None  # a late copy of a finished pull hands nothing out
    assert q.pull("p2") == second and q.stats()["unacked_batches"] == 1


def test_a_retry_whose_batch_is_acknowledged_while_it_reads_it_hands_nothing_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer got the first answer after all and acknowledged it while the retry read the
    batch again (a slow disk): the retry answers 204, not the acknowledged batch."""
    q = filled(tmp_path, 4)
    first = q.pull("p1")
    assert first is not None
    read_again = q.store.pull_again

    def ack_meanwhile(batch_id: str) -> Any:
        assert q.ack(first[0])
        return read_again(batch_id)

    monkeypatch.setattr(q.store, "pull_again", ack_meanwhile)
    assert q.pull("p1") is None
    monkeypatch.undo()
    assert ids(q.pull("p3")) == ["g2", "g3"]


def test_pulls_without_an_id_get_a_new_batch_each(tmp_path: Path) -> None:
    q = filled(tmp_path, 4)
    assert ids(q.pull()) == ["g0", "g1"] and ids(q.pull()) == ["g2", "g3"] and q.pull() is None


def test_a_retry_after_a_controller_restart_gets_the_batch_again(tmp_path: Path) -> None:
    q = filled(tmp_path, 6)
    first = q.pull("p1")
    q.store.close()
    again = make(tmp_path)
    assert again.pull("p1") == first
    assert ids(again.pull("p2")) == ["g2", "g3"]  # handed out once: the restart's re-hand-out is done


def test_a_retry_after_a_trainer_registers_is_not_handed_out_twice(tmp_path: Path) -> None:
    q = filled(tmp_path, 6)
    first = q.pull("p1")
    assert q.trainer_restarted()[1] == 1
    assert q.pull("p1") == first
    assert ids(q.pull("p2")) == ["g2", "g3"]


def test_concurrent_copies_of_one_pull_hand_out_one_batch(tmp_path: Path) -> None:
    q = filled(tmp_path, 8)
    got: list[tuple[str, list[bytes]] | None] = []
    threads = [threading.Thread(target=lambda: got.append(q.pull("same"))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(got) == 8 and all(batch == got[0] for batch in got)
    assert q.stats()["unacked_batches"] == 1 and q.stats()["queued_sequences"] == 24


def test_a_retry_whose_batch_was_lost_to_damage_gets_a_new_one(tmp_path: Path) -> None:
    q = filled(tmp_path, 4)
    first = q.pull("p1")
    assert first is not None
    for group_id in ("g0", "g1"):
        flip_byte(tmp_path, group_id, at=10)
    second = q.pull("p1")
    assert ids(second) == ["g2", "g3"] and second is not None  # nothing was left of the first: never delivered
    assert q.lost_ids_for(second[0]) == ["g0", "g1"] and q.stats()["unacked_batches"] == 1


def test_the_lost_ids_told_with_a_batch_are_told_again_until_its_ack(tmp_path: Path) -> None:
    q = filled(tmp_path, 6)
    flip_byte(tmp_path, "g1", at=10)
    first = q.pull("p1")
    assert ids(first) == ["g0", "g2"] and first is not None
    assert q.lost_ids_for(first[0]) == ["g1"]  # the answer carrying it was lost:
    again = q.pull("p1")
    assert again == first and q.lost_ids_for(first[0]) == ["g1"]  # the retry names it again
    assert q.ack(first[0])
    second = q.pull("p2")
    assert second is not None and q.lost_ids_for(second[0]) == []  # acknowledged: told for good


def group(gid: str) -> dict[str, object]:
    return {"id": gid, "worker_id": "0001", "policy_version": 0, "group_size": 1,
            "sequences": [{"tokens": [1, 2, 3], "score": 0.5}]}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedController]:
    server = ServedController(tmp_path, TOKEN, {"autoscaler": {"min_workers": 0}}, batch_size=2)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for i in range(6):
            assert http.post("/rollouts", json=group(f"g{i}")).json() == {"accepted": True}
    yield server
    server.close()


def test_the_auditors_dropped_connection_with_a_pull_id(served: ServedController) -> None:
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:  # asks, then goes away before the answer
        raw.sendall(f"POST /trainer/batch?pull_id=lost-1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}"
                    "\r\nContent-Length: 0\r\n\r\n".encode())
    deadline = time.monotonic() + 10
    while served.queue.stats()["unacked_batches"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    seen: list[str] = []
    with ControlClient(served.url, TOKEN) as client:
        for pull_id in ("lost-1", "next-1", "next-2", "next-3"):  # the retry first, with the same id
            batch = client.pull_batch(pull_id)
            if batch is None:
                break
            seen += [g["id"] for g in batch["groups"]]
            client.ack_batch(batch["batch_id"])
        status = client.global_status()["queue"]
    assert seen == [f"g{i}" for i in range(6)]
    assert (status["unacked_batches"], status["queued_sequences"], status["delivered_sequences"]) == (0, 0, 6)


def test_a_bad_pull_id_is_refused(served: ServedController) -> None:
    with ControlClient(served.url, TOKEN) as client:
        answer = client._http.post("/trainer/batch", params={"pull_id": "not one/id"})
    assert answer.status_code == 422 and "pull_id" in answer.text


class LosesFirstPullAnswer(httpx.HTTPTransport):
    """The controller hands the batch out; its answer never arrives (a timeout)."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path == "/trainer/batch" and not self.lost:
            response.read()
            response.close()
            self.lost += 1
            raise httpx.ReadTimeout("the answer was lost", request=request)
        return response


def take_three(trainer: Trainer) -> list[str]:
    """The group ids of the next three batches, each acknowledged."""
    seen: list[str] = []
    for _ in range(3):
        batch = trainer.next_batch(timeout_s=30)
        assert batch is not None
        seen += [g["id"] for g in batch.groups]
        trainer.ack(batch)
    return seen


def test_the_trainer_retries_a_lost_pull_and_gets_that_batch(served: ServedController) -> None:
    trainer = Trainer(served.url, TOKEN, poll_s=0.01)
    transport = LosesFirstPullAnswer()
    trainer.client = ControlClient(served.url, TOKEN, transport=transport)
    seen = take_three(trainer)
    assert transport.lost == 1 and seen == [f"g{i}" for i in range(6)]  # the lost one first, each once
    status = trainer.status()["queue"]
    assert (status["unacked_batches"], status["queued_sequences"], status["delivered_sequences"]) == (0, 0, 6)
    trainer.close()


def test_a_pull_lost_at_the_end_of_a_short_timeout_is_asked_for_by_the_next_call(served: ServedController) -> None:
    """``next_batch(timeout_s)`` ran out while its pull's answer was lost: the next call repeats
    that pull's id and gets its batch. Before, it asked under a new id and the batch stayed
    handed out to nobody (with ``max_staleness = 0`` the workers were never admitted again)."""
    trainer = Trainer(served.url, TOKEN, poll_s=0.01)
    transport = LosesFirstPullAnswer()
    trainer.client = ControlClient(served.url, TOKEN, transport=transport)
    assert trainer.next_batch(timeout_s=0.0001) is None  # the answer lost, no time left to retry
    assert transport.lost == 1 and trainer.status()["queue"]["unacked_batches"] == 1
    seen = take_three(trainer)
    assert seen == [f"g{i}" for i in range(6)]
    status = trainer.status()["queue"]
    assert (status["unacked_batches"], status["queued_sequences"], status["delivered_sequences"]) == (0, 0, 6)
    trainer.close()


def test_an_ack_of_an_unknown_batch_is_an_api_error_404(served: ServedController) -> None:
    from slurm_elastic.errors import ApiError

    with ControlClient(served.url, TOKEN) as client, pytest.raises(ApiError) as raised:
        client.ack_batch("0" * 32)
    assert raised.value.status_code == 404 and isinstance(raised.value, KeyError)
    assert str(raised.value) == raised.value.detail and "unknown batch" in str(raised.value)


def test_a_trainer_whose_controller_was_stopped_is_told_so(tmp_path: Path) -> None:
    """After ``slurm-elastic stop`` the trainer's next call raises ControllerStoppedError (before,
    it waited in silence, and ``batches()`` logged an hour later that workers may be pending)."""
    from slurm_elastic.errors import ControllerStoppedError

    server = ServedController(tmp_path, TOKEN, {"autoscaler": {"min_workers": 0}}, batch_size=2)
    trainer = Trainer(server.url, TOKEN, state_dir=tmp_path, poll_s=0.01)
    server.close()
    (tmp_path / "controller.json").write_text(json.dumps({"url": server.url, "stopped_by_operator_at": 1.7e9}))
    with pytest.raises(ControllerStoppedError, match="was stopped"):
        trainer.next_batch(timeout_s=30)
    trainer.close()
