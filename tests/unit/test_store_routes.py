"""The store's failures as the real HTTP server answers them and the trainer sees them: a
damaged group is named in the next batch (``lost_group_ids``), counted in ``/global-status``
and ``/metrics``, and surfaced by :class:`Trainer`; a full disk answers 503 with Retry-After to
a pull, an ack and a submit, and both sides go on once space is freed."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from slurm_elastic.trainer import Batch, Trainer
from tests.unit.served_controller import ServedController
from tests.unit.test_store_damage import flip_byte
from tests.unit.test_store_full_disk import fill, small_disk  # noqa: F401 (a fixture)

TOKEN = "store-token"


def group(gid: str) -> dict[str, object]:
    return {"id": gid, "worker_id": "0001", "policy_version": 0, "group_size": 4,
            "sequences": [{"tokens": [1, 2, 3, 4], "mask": [1, 1, 1, 1], "score": 0.5}] * 4}


class Served(ServedController):
    def __init__(self, state: Path) -> None:
        super().__init__(state, TOKEN, {"autoscaler": {"min_workers": 0}}, capacity_seqs=400, fsync="always")
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)

    def submit(self, gid: str) -> httpx.Response:
        return self.http.post("/rollouts", json=group(gid))

    def close(self) -> None:
        self.http.close()
        super().close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path)
    yield s
    s.close()


def test_a_damaged_group_is_named_to_the_trainer_and_counted(served: Served, tmp_path: Path) -> None:
    for gid in ["a", "b", "c", "d"]:
        assert served.submit(gid).json() == {"accepted": True}
    flip_byte(tmp_path, "b", at=30)
    told: list[list[str]] = []
    trainer = Trainer(served.server.url, TOKEN, on_lost=told.append, poll_s=0.01)
    batch = trainer.next_batch(timeout_s=30)
    assert batch is not None and [g["id"] for g in batch.groups] == ["a", "c"]
    assert batch.lost_group_ids == ("b",) and trainer.lost_group_ids == ["b"] and told == [["b"]]
    restarted_told: list[list[str]] = []  # the trainer died before its ack: the batch comes again, so does "b"
    restarted = Trainer(served.server.url, TOKEN, on_lost=restarted_told.append, poll_s=0.01)
    again = restarted.next_batch(timeout_s=30)
    assert again is not None and again.batch_id == batch.batch_id and restarted_told == [["b"]]
    restarted.ack(again)
    restarted.close()
    status = served.http.get("/global-status").json()
    assert (status["queue"]["lost_groups"], status["queue"]["lost_sequences"]) == (1, 4)
    assert "slurm_elastic_lost_groups_total 1.0" in served.http.get("/metrics").text
    trainer.close()


def test_a_full_disk_answers_503_and_nothing_is_lost(small_disk: Path) -> None:  # noqa: F811
    served = Served(small_disk)
    try:
        for i in range(8):
            assert served.submit(f"g{i}").json() == {"accepted": True}
        first = served.http.post("/trainer/batch").json()
        filler = fill(small_disk)
        pulled = served.http.post("/trainer/batch")
        assert pulled.status_code == 503 and int(pulled.headers["retry-after"]) >= 1
        acked = served.http.post(f"/trainer/batch/{first['batch_id']}/ack")
        submitted = [served.submit(f"late{i}") for i in range(3)]
        assert acked.status_code == 503 and int(acked.headers["retry-after"]) >= 1
        assert {r.status_code for r in submitted[1:]} == {503}, [r.text for r in submitted]
        assert "retry-after" in submitted[-1].headers
        filler.unlink()
        assert served.http.post(f"/trainer/batch/{first['batch_id']}/ack").json()["acked"] is True
        assert all(served.submit(f"late{i}").status_code == 200 for i in range(3))
        seen = []
        while (answer := served.http.post("/trainer/batch")).status_code == 200:
            batch = answer.json()
            seen += [g["id"] for g in batch["groups"]]
            assert served.http.post(f"/trainer/batch/{batch['batch_id']}/ack").json()["acked"] is True
        assert seen == [*(f"g{i}" for i in range(2, 8)), "late0", "late1"]  # late2 waits for another group
        assert json.loads(served.http.get("/global-status").text)["queue"]["queued_sequences"] == 4
    finally:
        served.close()


def test_the_trainer_waits_through_a_full_disk(small_disk: Path) -> None:  # noqa: F811
    served = Served(small_disk)
    try:
        for i in range(2):
            assert served.submit(f"g{i}").json() == {"accepted": True}
        trainer = Trainer(served.server.url, TOKEN, poll_s=0.01)
        filler = fill(small_disk)
        assert served.http.post("/trainer/batch").status_code == 503
        got: list[Batch | None] = []
        pulling = threading.Thread(target=lambda: got.append(trainer.next_batch(timeout_s=60)))
        pulling.start()
        pulling.join(0.5)  # asking again and again, answered 503
        filler.unlink()
        pulling.join(60)
        (batch,) = got
        assert batch is not None and [g["id"] for g in batch.groups] == ["g0", "g1"]
        trainer.close()
    finally:
        served.close()


def test_an_index_that_cannot_be_read_answers_503_and_the_groups_stay_queued(served: Served) -> None:
    for gid in ["a", "b"]:
        assert served.submit(gid).json() == {"accepted": True}
    served.queue.store._index.db.close()  # type: ignore[attr-defined]  # every read of the index fails in SQLite
    answer = served.http.post("/trainer/batch")
    assert answer.status_code == 503 and answer.headers["retry-after"] == "2", answer.text
    assert served.http.get("/global-status").json()["queue"]["queued_sequences"] == 8
