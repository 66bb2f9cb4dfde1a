"""One trainer per job, enforced: each registration gets a session, and the calls of a trainer
registered before the newest one are refused (409), also across a controller restart, so a second
live trainer fails loudly instead of sharing (and re-training) the batches."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from slurm_elastic.errors import TrainerSupersededError
from slurm_elastic.rollouts.queue import TrainerSessionUnknown, TrainerSuperseded
from slurm_elastic.trainer import Trainer
from tests.unit.test_rollout_queue import make, submit
from tests.unit.test_trainer_holds import TOKEN, serve
from tests.unit.test_trainer_holds import submit as submit_over_http


def test_an_older_session_is_refused_everywhere_and_a_sessionless_caller_is_not_checked(tmp_path: Path) -> None:
    q = make(tmp_path, capacity_seqs=100)
    for i in range(6):
        submit(q, f"g{i}")
    first, _ = q.trainer_restarted()
    second, _ = q.trainer_restarted()
    assert second > first
    with pytest.raises(TrainerSuperseded, match="one Trainer per job"):
        q.pull("p1", first)
    with pytest.raises(TrainerSuperseded):
        q.set_version(1, session=first)
    batch = q.pull("p2", second)
    assert batch is not None
    with pytest.raises(TrainerSuperseded):
        q.ack(batch[0], first)
    assert q.stats()["policy_version"] == 0 and q.stats()["unacked_batches"] == 1  # the refusals changed nothing
    assert q.ack(batch[0], second)
    assert q.pull() is not None  # the raw API, without a session: as before


def test_the_newest_session_survives_a_controller_restart(tmp_path: Path) -> None:
    q = make(tmp_path, capacity_seqs=100)
    for i in range(4):
        submit(q, f"g{i}")
    old, _ = q.trainer_restarted()
    new, _ = q.trainer_restarted()
    q.store.close()
    again = make(tmp_path, capacity_seqs=100)
    with pytest.raises(TrainerSuperseded):
        again.pull(None, old)
    assert again.pull(None, new) is not None
    newer, _ = again.trainer_restarted()
    assert newer > new  # later than every session before the restart, whatever the clock says


def test_a_second_live_trainer_supersedes_the_first_which_fails_loudly(tmp_path: Path) -> None:
    server = serve(tmp_path)
    submit_over_http(server, 6)
    first = Trainer(server.url, TOKEN, state_dir=tmp_path, poll_s=0.01)
    held = first.next_batch(timeout_s=10)
    assert held is not None
    second = Trainer(server.url, TOKEN, state_dir=tmp_path, poll_s=0.01)  # e.g. every rank made one
    with pytest.raises(TrainerSupersededError, match="one Trainer per job") as refused:
        first.next_batch(timeout_s=10)
    assert refused.value.status_code == 409
    with pytest.raises(TrainerSupersededError):
        first.ack(held)
    with pytest.raises(TrainerSupersededError):
        first.publish_version(1)
    got = [second.next_batch(timeout_s=10) for _ in range(3)]
    assert got[0] is not None and got[0].batch_id == held.batch_id  # what the first held goes to the second
    seen = sorted(g["id"] for b in got if b is not None for g in b.groups)
    assert seen == [f"g{i}" for i in range(6)]  # each once, all to the newer trainer
    for batch in got:
        assert batch is not None
        second.ack(batch)
    assert second.publish_version(1)["policy_version"] == 1
    assert server.queue.stats()["delivered_sequences"] == 6
    first.close()
    second.close()
    server.close()


def test_the_session_is_checked_as_a_query_parameter(tmp_path: Path) -> None:
    server = serve(tmp_path)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        session = http.post("/trainer/register", json={"trainer_id": "t"}).json()["trainer_session"]
        assert http.post("/trainer/register", json={"trainer_id": "t"}).json()["trainer_session"] > session
        refused = http.post("/trainer/batch", params={"trainer_session": session})
        assert refused.status_code == 409 and "superseded" in refused.json()["detail"]
        bad = http.post("/trainer/batch", params={"trainer_session": "x"})
        assert bad.status_code == 422 and "trainer_session" in bad.text
        assert http.post("/trainer/batch", params={"trainer_session": 0}).status_code == 422
    server.close()


def test_a_session_never_issued_is_refused_with_what_to_send(tmp_path: Path) -> None:
    q = make(tmp_path, capacity_seqs=100)
    for i in range(4):
        submit(q, f"g{i}")
    with pytest.raises(TrainerSessionUnknown, match="never issued session 5"):
        q.pull("p0", 5)  # no trainer registered yet
    issued, _ = q.trainer_restarted()
    for call in (lambda: q.pull("p1", issued + 1), lambda: q.set_version(1, session=issued + 1)):
        with pytest.raises(TrainerSessionUnknown, match=f"never issued session {issued + 1}"):
            call()
    assert q.stats()["policy_version"] == 0 and q.stats()["unacked_batches"] == 0  # nothing changed
    assert q.pull("p2", issued) is not None
    q.store.close()

    (tmp_path / "http").mkdir()
    server = serve(tmp_path / "http")
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        session = http.post("/trainer/register", json={"trainer_id": "t"}).json()["trainer_session"]
        for path in ("/trainer/batch", "/trainer/version"):
            answer = http.post(path, params={"trainer_session": session + 10}, json={"version": 1})
            assert answer.status_code == 409, (path, answer.text)
            assert answer.json()["detail"].startswith(f"trainer session unknown: this controller never issued "
                                                      f"session {session + 10}")
        assert http.post("/trainer/version", params={"trainer_session": session}, json={"version": 1}).status_code == 200
    server.close()
