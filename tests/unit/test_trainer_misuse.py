"""A trainer written from the docs, misused as users do: versions that go back or jump, a restart
mid-run that resumes, calls after ``close()``. Each gets a clear error and no batch is lost.
Before, a call after ``close()`` raised httpx's "Cannot send a request, as the client has been
closed"."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_elastic.client.control import ControlClient
from slurm_elastic.errors import ApiError, TrainerSupersededError
from slurm_elastic.trainer import Trainer
from tests.unit.served_controller import ServedController

TOKEN = "trainer-misuse-token"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedController]:
    server = ServedController(tmp_path, TOKEN, batch_size=8).launched("0001")
    yield server
    server.close()


def submit(served: ServedController, *ids: str, version: int = 0) -> None:
    with ControlClient(served.url, TOKEN) as client:
        for group_id in ids:
            answer = client.submit_group({"id": group_id, "worker_id": "0001", "policy_version": version,
                                          "group_size": 4, "sequences": [{"tokens": [1], "score": 0.0}] * 4})
            assert answer == {"accepted": True}


def test_versions_that_go_back_or_jump_are_refused_naming_recovered(served: ServedController, tmp_path: Path) -> None:
    trainer = Trainer(served.url, TOKEN, tmp_path)
    trainer.publish_version(2)
    with pytest.raises(ApiError, match=r"policy version 1 is lower than the current 2.*recovered=true") as back:
        trainer.publish_version(1)
    with pytest.raises(ApiError, match=r"jumps 6 past the current 2.*max_staleness \+ 1 = 5") as jump:
        trainer.publish_version(8)
    assert back.value.status_code == jump.value.status_code == 409
    assert trainer.publish_version(7)["policy_version"] == 7  # max_staleness + 1 past it: allowed
    trainer.close()


def test_a_trainer_restarted_mid_run_resumes_with_the_batch_it_held(served: ServedController, tmp_path: Path) -> None:
    first = Trainer(served.url, TOKEN, tmp_path)
    submit(served, "a", "b", "c", "d")
    done = first.next_batch(timeout_s=5)
    held = first.next_batch(timeout_s=5)
    assert done is not None and held is not None
    first.ack(done)
    first.publish_version(1)  # then it dies holding `held`, unacknowledged
    again = Trainer(served.url, TOKEN, tmp_path)
    assert again.info["unacked_batches_handed_again"] == 1
    with pytest.raises(TrainerSupersededError):  # the old process takes nothing the new one is owed
        first.ack(held)
    assert again.publish_version(1, recovered=True)["policy_version"] == 1
    resent = again.next_batch(timeout_s=5)
    assert resent is not None and resent.batch_id == held.batch_id
    assert [g["id"] for g in resent.groups] == [g["id"] for g in held.groups]
    again.ack(resent)
    assert served.queue.stats()["queued_sequences"] == 0
    again.close()


def test_calls_after_close_say_so(served: ServedController, tmp_path: Path) -> None:
    trainer = Trainer(served.url, TOKEN, tmp_path)
    trainer.close()
    for call in (lambda: trainer.next_batch(timeout_s=1), lambda: trainer.publish_version(1), trainer.status):
        with pytest.raises(RuntimeError, match=r"Trainer used after close\(\)"):
            call()


def test_a_trainer_waiting_for_groups_that_make_no_batch_says_why(
        served: ServedController, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("slurm_elastic.trainer.WAITING_LOG_S", 0.3)
    trainer = Trainer(served.url, TOKEN, tmp_path, poll_s=0.05)
    with ControlClient(served.url, TOKEN) as client:
        for group_id in ("a", "b", "c"):  # groups of 3 never make a batch of 8
            client.submit_group({"id": group_id, "worker_id": "0001", "policy_version": 0, "group_size": 3,
                                 "sequences": [{"tokens": [1], "score": 0.0}] * 3})
    with caplog.at_level(logging.WARNING, logger="slurm_elastic.trainer"):
        assert trainer.next_batch(timeout_s=1.0) is None
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("no batch for")]
    assert told and "9 sequences are queued, a batch's worth, but no whole groups among them make exactly 8" in told[0]
    assert len(told) <= 3  # once per WAITING_LOG_S, not per poll
    trainer.close()


def test_a_trainer_waiting_on_workers_that_run_is_told_at_info_not_warned(
        served: ServedController, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow step or a warm-up is no mistake: a warning every minute of a healthy run was noise."""
    monkeypatch.setattr("slurm_elastic.trainer.WAITING_LOG_S", 0.3)
    real_status = served.controller.status
    monkeypatch.setattr(served.controller, "status",
                        lambda: {**real_status(), "workers_by_state": {"ACTIVE": 2, "STARTING": 1}})
    trainer = Trainer(served.url, TOKEN, tmp_path, poll_s=0.05)
    with caplog.at_level(logging.INFO, logger="slurm_elastic.trainer"):
        assert trainer.next_batch(timeout_s=1.0) is None
    told = [r for r in caplog.records if r.getMessage().startswith("no batch for")]
    assert told and all(r.levelno == logging.INFO for r in told), [(r.levelname, r.getMessage()) for r in told]
    assert "2 worker(s) active, 1 starting" in told[0].getMessage()
    trainer.close()


def test_a_trainer_that_does_not_publish_its_versions_is_warned(
        served: ServedController, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers ACTIVE but held at the staleness gate, because the trainer took batches without
    publishing a version: the one mistake the INFO branch would hide."""
    trainer = Trainer(served.url, TOKEN, tmp_path)
    numbers = {"queue_size": 0, "batch_size": 8, "connected_workers": 4, "workers_by_state": {"ACTIVE": 4},
               "staleness_capacity": 0, "current_step": 0, "total_processed": 40}
    monkeypatch.setattr(trainer.client, "global_status", lambda: numbers)
    with caplog.at_level(logging.INFO, logger="slurm_elastic.trainer"):
        trainer._tell_waiting(61.0)
    [told] = [r for r in caplog.records if r.getMessage().startswith("no batch for")]
    assert told.levelno == logging.WARNING and "took 5 batches but published version 0" in told.getMessage()
    assert "publish_version" in told.getMessage()
    trainer.close()


def test_a_trainer_waiting_through_the_drain_before_the_time_limit_is_told_so(
        served: ServedController, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker drains workers.end_drain_s before the job's time limit: the trainer's minute
    without a batch names that, not "no worker is active or starting" (a dev cluster job with a
    4-minute limit said only that, as if the workers had failed)."""
    trainer = Trainer(served.url, TOKEN, tmp_path)
    numbers = {"queue_size": 8, "batch_size": 32, "connected_workers": 0, "workers_by_state": {"INACTIVE": 5},
               "staleness_capacity": 96, "current_step": 118, "total_processed": 3776,
               "controller": {"last_decision": {"action": "drain"}, "time_limit_in_s": 54.2}}
    monkeypatch.setattr(trainer.client, "global_status", lambda: numbers)
    with caplog.at_level(logging.INFO, logger="slurm_elastic.trainer"):
        trainer._tell_waiting(61.0)
    [told] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("no batch for")]
    assert "every worker drained before the job's time limit (54 s away)" in told and "TimeLimit" in told
    numbers["controller"] = {"last_decision": {"action": "hold"}, "time_limit_in_s": None}
    trainer._waiting_told_s = -1e9
    with caplog.at_level(logging.INFO, logger="slurm_elastic.trainer"):
        trainer._tell_waiting(61.0)
    assert "8 of the 32 sequences a batch needs are queued, and no worker is active or starting" in caplog.text
    trainer.close()
