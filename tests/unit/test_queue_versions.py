"""Submits for a policy version no trainer step can use: one already too stale is answered as not
accepted (with the versions) and its worker's lease gives those sequences back; one past the
trainer's version is refused (409 naming the field and the current version). Neither is stored,
and the worker SDK goes on after either."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue, StaleGroup, VersionAhead
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.worker import RolloutWorker, StepContext
from tests.unit.served_controller import ServedController

TOKEN = "version-token"


def make_config() -> QueueConfig:
    return QueueConfig(batch_size=1, capacity_seqs=100, max_staleness=4, max_concurrent=1000, fsync="off")


def make(tmp: Path) -> RolloutQueue:
    return RolloutQueue(RolloutStore(tmp / "q.sqlite", fsync="off"), make_config(), clock=lambda: 1000.0)


def at_version_10(tmp: Path) -> RolloutQueue:
    q = make(tmp)
    for version in range(1, 11):
        q.set_version(version)
    return q


def submit(q: RolloutQueue, group_id: str, version: int, n: int = 1, worker: str = "0001") -> bool:
    return q.submit(group_id, worker, n, version, b'{"id": "%s"}' % group_id.encode())


def test_a_stale_group_is_refused_with_the_versions_and_not_stored(tmp_path: Path) -> None:
    q = at_version_10(tmp_path)
    with pytest.raises(StaleGroup) as refused:
        submit(q, "old", 0)
    assert (refused.value.policy_version, refused.value.current_version, refused.value.max_staleness) == (0, 10, 4)
    assert "stale" in str(refused.value) and "version 6 or newer" in str(refused.value)
    assert submit(q, "oldest-fresh", 6)  # version - max_staleness: still taken
    stats = q.stats()
    assert (stats["queued_sequences"], stats["dropped_stale_sequences"], stats["refused_stale_sequences"]) == (1, 0, 1)
    assert q.pull() is not None and q.pull() is None


def test_a_stale_refusal_gives_the_lease_back_and_that_survives_a_restart(tmp_path: Path) -> None:
    q = at_version_10(tmp_path)
    assert q.admit(6, "0001") == 6
    with pytest.raises(StaleGroup):
        submit(q, "old", 3, n=4)
    assert q.staleness.running == 2 and q.leases.leases["0001"].unused_seqs == 2
    q.store.close()
    again = make(tmp_path)
    assert again.staleness.running == 2 and again.leases.leases["0001"].unused_seqs == 2
    assert again.stats()["staleness_capacity"] == q.stats()["staleness_capacity"]


def test_a_lease_whose_step_ended_is_released_and_that_survives_a_restart(tmp_path: Path) -> None:
    q = at_version_10(tmp_path)
    assert q.admit(3, "0001") == 3 and q.admit(2, "0002") == 2 and q.staleness.running == 5
    assert q.release_leases(["0001", "0003"]) == 3  # 0003 holds nothing
    assert q.staleness.running == 2 and "0001" not in q.leases.leases
    assert q.release_leases([]) == 0 and q.release_leases(["0001"]) == 0  # released once
    q.store.close()
    again = make(tmp_path)
    assert again.staleness.running == 2 and again.stats()["staleness_capacity"] == q.stats()["staleness_capacity"]
    assert submit(again, "late", 10, worker="0001")  # the ended step's late submit: accepted, unadmitted
    assert again.staleness.running == 2


def test_a_stale_refusal_is_answered_even_when_its_counts_cannot_be_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    q = at_version_10(tmp_path)
    assert q.admit(4, "0001") == 4

    def full_disk(key: str, value: str, transition: bool = False) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(q.store, "set_meta", full_disk)
    with caplog.at_level(logging.WARNING), pytest.raises(StaleGroup):
        submit(q, "old", 0, n=4)
    assert q.staleness.running == 0 and "could not save the staleness counts" in caplog.text
    monkeypatch.undo()
    assert q.admit(1, "0002") == 1  # the next save holds the refusal too
    q.store.close()
    assert make(tmp_path).staleness.running == 1


def test_a_group_ahead_of_the_trainer_is_refused_and_its_sequences_leave_the_lease(tmp_path: Path) -> None:
    """As a stale one's do (AReaL's on_rollout_rejected): kept, they held the staleness capacity
    for as long as the worker lived (a trainer resumed at an earlier version, seen on a live job)."""
    q = at_version_10(tmp_path)
    assert q.admit(2, "0001") == 2
    for version in (11, 10**15, 2**63 - 1):
        with pytest.raises(VersionAhead) as refused:
            submit(q, f"future-{version}", version)
        assert (refused.value.policy_version, refused.value.current_version) == (version, 10)
        assert "ahead of the trainer's current policy version 10" in str(refused.value)
    assert q.stats()["queued_sequences"] == 0 and q.staleness.running == 0
    assert "0001" not in q.leases.leases and len(q.leases.refused["0001"]) == 3  # a resend releases nothing
    q.store.close()
    assert make(tmp_path).staleness.running == 0  # saved before the refusal was answered


def test_a_resend_of_a_delivered_group_at_a_version_now_stale_or_ahead_is_a_retry(tmp_path: Path) -> None:
    """A worker whose first answer was lost sends the group again, later: it was stored, so the
    answer is a retry, and nothing of the worker's current lease is released for it."""
    q = make(tmp_path)
    assert submit(q, "g", 0) and submit(q, "h", 0)
    for _ in range(2):
        batch = q.pull()
        assert batch is not None
        q.ack(batch[0])
    for version in range(1, 6):
        q.set_version(version)  # g and h are stale now
    assert q.admit(3, "0001") == 3
    assert submit(q, "g", 0) is False  # not StaleGroup: its sequence is not taken off the lease
    assert q.staleness.running == 3 and q.leases.leases["0001"].unused_seqs == 3
    q.set_version(0, recovered=True)  # a resume from an earlier checkpoint: h is "ahead" now
    assert submit(q, "h", 5) is False  # not VersionAhead: it was stored (and trained on) before
    with pytest.raises(VersionAhead):
        submit(q, "new", 5)


def test_a_resend_of_a_queued_group_that_went_stale_is_a_retry(tmp_path: Path) -> None:
    q = make(tmp_path)
    assert submit(q, "g", 0)
    q.set_version(5)  # g is stale now, still queued until the next pull
    assert submit(q, "g", 0) is False  # accepted already: not refused, not stored twice
    assert q.pull() is None and q.stats()["dropped_stale_sequences"] == 1


def with_a_clock(tmp_path: Path) -> tuple[RolloutQueue, list[float]]:
    """The queue of :func:`make` on a clock the test moves (``now[0]``)."""
    now = [1000.0]
    return RolloutQueue(RolloutStore(tmp_path / "q.sqlite", fsync="off"), make_config(), clock=lambda: now[0]), now


def test_the_trainers_last_call_is_timed(tmp_path: Path) -> None:
    q, now = with_a_clock(tmp_path)
    assert q.stats()["trainer_last_call_s_ago"] is None
    q.trainer_restarted()
    now[0] += 12.5
    assert q.stats()["trainer_last_call_s_ago"] == 12.5
    assert q.pull() is None  # a poll that finds no batch is a call too
    now[0] += 1.0
    q.set_version(1)
    assert q.stats()["trainer_last_call_s_ago"] == 0.0


def test_a_new_trainer_does_not_inherit_the_step_its_killed_predecessor_left_running(tmp_path: Path) -> None:
    q, now = with_a_clock(tmp_path)
    for group_id in "abc":
        assert submit(q, group_id, 0)
    for _ in range(2):  # two 1 s steps
        batch = q.pull()
        assert batch is not None
        now[0] += 1.0
        q.ack(batch[0])
    assert q.pull() is not None  # the third batch: then the trainer is killed mid-step
    now[0] += 80.0
    assert q.stats()["trainer_step_s"] == 80.0  # a step in progress that long shows as such
    q.trainer_restarted()
    assert q.stats()["trainer_step_s"] == 1.0 and q.stats()["trainer_wait_fraction"] == 0.0


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedController]:
    server = ServedController(tmp_path, TOKEN, {"autoscaler": {"min_workers": 0}}, batch_size=1)
    for version in range(1, 11):
        server.queue.set_version(version)
    yield server
    server.close()


def group(gid: str, version: int) -> dict[str, object]:
    return {"id": gid, "worker_id": "0001", "policy_version": version, "group_size": 1,
            "sequences": [{"tokens": [1, 2, 3], "score": 0.5}]}


def test_the_routes_answer_the_auditors_versions(served: ServedController) -> None:
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        stale = http.post("/rollouts", json=group("old", 0))
        assert stale.status_code == 200
        answer = stale.json()
        assert (answer["accepted"], answer["reason"], answer["policy_version"], answer["current_version"],
                answer["max_staleness"]) == (False, "stale", 0, 10, 4)
        assert "not stored" in answer["detail"]
        ahead = http.post("/rollouts", json=group("future", 10**15))
        assert ahead.status_code == 409
        [error] = ahead.json()["detail"]
        assert error["loc"] == ["body", "policy_version"] and error["current_version"] == 10
        assert "current policy version 10" in error["msg"]
        assert http.post("/rollouts", json=group("fresh", 10)).json() == {"accepted": True}
        pulled = http.post("/trainer/batch")
        assert [g["id"] for g in pulled.json()["groups"]] == ["fresh"]
        assert http.post("/trainer/batch").status_code == 204
        queue = http.get("/status").json()["queue"]
    assert (queue["queued_sequences"], queue["dropped_stale_sequences"]) == (0, 0)


def test_the_worker_sdk_goes_on_after_either_refusal(served: ServedController,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    ctx = StepContext(worker_id="0001", controller_url=served.url, token=TOKEN, heartbeat_interval_s=60,
                      drain_signal="USR1", node="node1", gpus=(0,), step_id="3", job_id="1")
    worker = RolloutWorker(ctx)
    try:
        with caplog.at_level(logging.INFO, logger="slurm_elastic.worker"):
            stale = worker.submit({"id": "old", "policy_version": 0, "group_size": 1,
                                   "sequences": [{"tokens": [1, 2], "score": 1.0}]})
            ahead = worker.submit({"id": "new", "policy_version": 11, "group_size": 1,
                                   "sequences": [{"tokens": [1, 2], "score": 1.0}]})
        assert (stale["accepted"], stale["reason"]) == (False, "stale")
        assert (ahead["accepted"], ahead["reason"]) == (False, "policy_version_ahead")
        assert "policy_version 11 is ahead" in ahead["detail"]
        assert "rollout group old not stored" in caplog.text and "rollout group new not stored" in caplog.text
        assert served.queue.stats()["queued_sequences"] == 0
    finally:
        worker.close()


def test_a_trainer_back_at_an_earlier_checkpoint_gets_no_group_made_past_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Groups queued at versions past the one a trainer resumed at come from the weights of the
    run it went back from: dropped at the next pull like stale ones (counted, their capacity
    freed, logged), as a submit of one now is refused, and after a controller restart as well."""
    q = at_version_10(tmp_path)
    for version in (7, 8, 9, 10):
        assert submit(q, f"v{version}", version)
    q.set_version(8, recovered=True)  # the last checkpoint was at version 8
    assert q.stats()["queued_sequences"] == 4  # counted in the buffer until the pull drops them
    with caplog.at_level(logging.WARNING, logger="slurm_elastic.rollouts.queue"):
        pulled = [q.pull() for _ in range(3)]
    assert [p[1] for p in pulled if p is not None] == [[b'{"id": "v7"}'], [b'{"id": "v8"}']]
    assert pulled[2] is None
    for batch in pulled[:2]:
        assert batch is not None and q.ack(batch[0])
    stats = q.stats()
    assert stats["dropped_stale_sequences"] == 2 and stats["queued_sequences"] == 0
    assert q.staleness.accepted == 8 * 1 + 2  # anchored at V * batch + the 4 buffered, less the 2 dropped
    assert "made at versions 9..10, past version 8 the trainer resumed at" in caplog.text

    assert submit(q, "w9", 8)  # and the same after the controller restarts with groups ahead queued
    q.set_version(9)
    assert submit(q, "w9b", 9)
    q.set_version(7, recovered=True)
    store = q.store
    q = RolloutQueue(store, make_config(), clock=lambda: 1000.0)
    assert q.pull() is None
    assert q.stats()["dropped_stale_sequences"] == 4 and q.stats()["queued_sequences"] == 0
    with pytest.raises(VersionAhead):
        submit(q, "late9", 9)


def test_a_batch_handed_out_before_the_resume_comes_again_without_its_groups_made_past_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The trainer held a batch (unacknowledged) when it went back to an earlier checkpoint: it is
    handed again with its id, without the groups made past the version it resumed at (dropped,
    counted, capacity freed); one made only of such groups is settled and the next one comes."""
    config = QueueConfig(batch_size=2, capacity_seqs=100, max_staleness=4, max_concurrent=1000, fsync="off")
    q = RolloutQueue(RolloutStore(tmp_path / "q.sqlite", fsync="off"), config, clock=lambda: 1000.0)
    for version in range(1, 11):
        q.set_version(version)
    for name, version in (("a7", 7), ("b9", 9), ("c10", 10), ("d10", 10), ("e8", 8), ("f8", 8)):
        assert submit(q, name, version)
    held = [q.pull() for _ in range(3)]  # (a7, b9), (c10, d10), (e8, f8): none acknowledged
    assert all(b is not None for b in held)
    q.trainer_restarted()
    q.set_version(8, recovered=True)
    with caplog.at_level(logging.WARNING, logger="slurm_elastic.rollouts.queue"):
        again = [q.pull() for _ in range(3)]
    assert again[0] is not None and held[0] is not None and again[0][0] == held[0][0]
    assert again[0][1] == [b'{"id": "a7"}']  # b9 left out
    assert again[1] is not None and held[2] is not None and again[1][0] == held[2][0]  # (c10, d10) is settled
    assert again[2] is None
    stats = q.stats()
    assert stats["dropped_stale_sequences"] == 3 and stats["unacked_batches"] == 2
    assert q.staleness.accepted == 8 * 2 + 6 - 3  # anchored with the 6 buffered, less the 3 dropped
    assert "dropped 1 handed-out (batch" in caplog.text and "made at versions 10..10" in caplog.text
    for batch in again[:2]:
        assert batch is not None and q.ack(batch[0])
    assert q.stats()["delivered_sequences"] == 3
    q.store.close()
    reopened = RolloutQueue(RolloutStore(tmp_path / "q.sqlite", fsync="off"), config, clock=lambda: 1000.0)
    assert reopened.stats()["dropped_stale_sequences"] == 3 and reopened.stats()["delivered_sequences"] == 3
    reopened.store.close()
