"""The rollout queue through the real controller: payloads, errors, backpressure, and exactly-once
delivery across kill -9 of the controller under load."""

from __future__ import annotations

import base64
import os
import signal
import struct
import threading
import time
from typing import Any

import httpx
import pytest

from slurm_elastic.client.control import ControlClient
from slurm_elastic.errors import ApiError
from slurm_elastic.trainer import Trainer
from tests.cluster.controller_harness import ControllerJob, locate_in, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.second_cluster]
QUEUE = {"queue": {"batch_size": 8, "capacity_seqs": 32, "max_group_bytes": 200_000}}


def group(gid: str, n: int = 4, version: int = 0) -> dict[str, Any]:
    tokens = base64.b64encode(struct.pack("<4i", 1, 2, 3, 4)).decode()
    return {"id": gid, "worker_id": "0001", "policy_version": version, "group_size": n,
            "sequences": [{"tokens_b64": tokens, "score": 0.5, "mask": [1, 1, 1, 1]} for _ in range(n)],
            "metadata": {"env": "test"}}


def client(job: ControllerJob) -> ControlClient:
    url, token = locate_in(job.state_dir, job.job_id)
    return ControlClient(url, token)


@pytest.mark.parametrize("job", [QUEUE], indirect=True)
def test_submit_pull_ack_round_trip_and_status(job: ControllerJob) -> None:
    with client(job) as c:
        assert c.submit_group(group("a")) == {"accepted": True}
        assert c.submit_group(group("a")) == {"accepted": False}  # a retry is not stored twice
        c.submit_group(group("b"))
        batch = c.pull_batch()
        assert batch is not None and [g["id"] for g in batch["groups"]] == ["a", "b"]
        assert batch["groups"][0] == group("a")  # exactly what the worker sent
        time.sleep(0.5)  # the trainer computes, then asks again: its step time is measured from its pulls
        assert c.pull_batch() is None
        assert c.ack_batch(batch["batch_id"])["acked"] is True
        status = c.global_status()
        assert 0.5 <= status["queue"]["trainer_step_s"] < 5.0
        assert status["total_processed"] == 8 and status["queue_size"] == 0 and status["batch_size"] == 8
        for key in ("current_step", "connected_workers", "rollout_pressure", "staleness_capacity",
                    "workers_by_state", "cordoned_gpus"):
            assert key in status
        metrics = httpx.get(f"{c.url}/metrics", headers={"Authorization": f"Bearer {_token(job)}"}).text
        assert "slurm_elastic_delivered_sequences_total 8.0" in metrics


def _token(job: ControllerJob) -> str:
    return locate_in(job.state_dir, job.job_id)[1]


@pytest.mark.parametrize("job", [QUEUE], indirect=True)
def test_bad_input_gets_clear_errors_and_changes_nothing(job: ControllerJob) -> None:
    with client(job) as c:
        with pytest.raises(ApiError) as bad:
            c.submit_group({**group("x"), "group_size": 3})
        assert bad.value.status_code == 422 and "group_size is 3 but 4 sequences" in bad.value.detail
        with pytest.raises(ApiError) as bad:
            c.submit_group({**group("y"), "policy_version": -1})
        assert bad.value.status_code == 422 and "policy_version" in bad.value.detail
        huge = group("z")
        huge["metadata"] = {"blob": "x" * 300_000}
        with pytest.raises(ApiError) as too_big:
            c.submit_group(huge)
        assert too_big.value.status_code == 413
        with pytest.raises(ApiError) as bad_json:
            c.submit_group(b"{not json")
        assert bad_json.value.status_code == 422
        with pytest.raises(KeyError):
            c.ack_batch("0" * 32)
        assert c.global_status()["queue_size"] == 0
    no_token = httpx.post(f"{c.url}/rollouts", json=group("n"))
    assert no_token.status_code == 401


@pytest.mark.parametrize("job", [QUEUE], indirect=True)
def test_backpressure_429_and_the_sdk_waits_without_losing_the_rollout(job: ControllerJob) -> None:
    with client(job) as c:
        for i in range(8):
            c.submit_group(group(f"g{i}"))  # 32 sequences: full
        raw = httpx.post(f"{c.url}/rollouts", json=group("late"), headers={"Authorization": f"Bearer {_token(job)}"})
        assert raw.status_code == 429 and int(raw.headers["retry-after"]) >= 1
        done: list[dict[str, Any]] = []
        waiter = threading.Thread(target=lambda: done.append(c.submit_group(group("late"))))
        waiter.start()
        time.sleep(1.5)
        assert not done  # still backing off
        with client(job) as trainer:
            batch = trainer.pull_batch()
            assert batch is not None
            trainer.ack_batch(batch["batch_id"])
        waiter.join(timeout=30)
        assert done == [{"accepted": True}]
        assert c.global_status()["queue"]["refused_submits"] >= 2


@pytest.mark.parametrize("job", [{"queue": {"batch_size": 8, "capacity_seqs": 400}}], indirect=True)
def test_kill_9_of_the_controller_under_load_delivers_every_acknowledged_rollout_once(job: ControllerJob) -> None:
    acknowledged: set[str] = set()  # the submit returned: the group is on disk
    delivered: list[str] = []  # group ids in batches the trainer acknowledged
    stop = threading.Event()
    lock = threading.Lock()

    def submitter(k: int) -> None:
        with client(job) as c:
            n = 0
            while not stop.is_set():
                n += 1
                gid = f"s{k}-{n}"
                c.submit_group(group(gid), max_wait_s=60)  # retries through the restart; idempotent by id
                with lock:
                    acknowledged.add(gid)

    def consume() -> None:
        url, token = locate_in(job.state_dir, job.job_id)
        trainer = Trainer(url, token, state_dir=job.state_dir, poll_s=0.05)
        while True:
            batch = trainer.next_batch(timeout_s=1.0)
            if batch is None:
                if stop.is_set():
                    break
                continue
            trainer.ack(batch)
            with lock:
                delivered.extend(g["id"] for g in batch.groups)
        trainer.close()

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(3)] + [threading.Thread(target=consume)]
    for t in threads:
        t.start()
    for _ in range(2):  # kill -9 twice, mid submit / mid hand-out
        time.sleep(2.0)
        pid = job.controller_pid()
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda p=pid: job.controller_pid() != p, 30, "a new controller")
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(timeout=90)
    with client(job) as c:
        queued_groups = c.global_status()["queue"]["queued_groups"]
    assert len(acknowledged) > 20
    assert len(delivered) == len(set(delivered))  # nothing delivered twice
    assert set(delivered) <= acknowledged  # nothing delivered that was not submitted
    assert len(acknowledged) == len(delivered) + queued_groups  # nothing acknowledged was lost
