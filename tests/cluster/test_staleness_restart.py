"""kill -9 of the live controller with groups buffered (queued and handed out), admissions in
flight and a worker dead mid-rollout: the restarted controller reports the staleness capacity
AReaL's own class gives for the same operations; then a trainer back at an earlier checkpoint
gets no group made past it."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from tests.cluster.controller_harness import ControllerJob, wait_for
from tests.cluster.test_queue_api import client, group
from tests.unit.areal_reference import load_staleness_manager

pytestmark = [pytest.mark.cluster, pytest.mark.second_cluster]
QUEUE = {"queue": {"batch_size": 8, "capacity_seqs": 400, "max_staleness": 3, "max_concurrent": 100},
         # two workers that run on (fake workers ask for no admissions): the test's own admissions are
         # theirs, held while their steps run (the controller refuses ids it did not launch)
         "workers": {"initial_workers": 2}, "autoscaler": {"min_workers": 2, "max_workers": 2}}


class Trainer:
    version = 0

    def get_version(self) -> int:
        return self.version


@pytest.mark.parametrize("job", [QUEUE], indirect=True)
def test_kill_9_keeps_the_staleness_counts_of_areals_class(job: ControllerJob) -> None:
    trainer = Trainer()
    areal = load_staleness_manager()(trainer, 100, 8, 3)

    def started(n: int) -> None:
        for _ in range(n):
            areal.on_rollout_enqueued()
            areal.on_rollout_submitted()

    wait_for(lambda: {w["worker_id"]: w["state"] for w in job.status()["workers"]} == {"0001": "ACTIVE", "0002": "ACTIVE"},
             60, "two active workers")
    with client(job) as c:
        assert c.set_version(2, recovered=True)["policy_version"] == 2
        trainer.version = 2
        areal.on_version_recovered(2)
        # 0002's rollout never comes back (its lease is held while its step runs)
        assert c.admit(20, "0001")["granted"] == 20 and c.admit(4, "0002")["granted"] == 4
        started(24)
        for i in range(4):
            c.submit_group({**group(f"k{i}"), "worker_id": "0001", "policy_version": 2})
            for _ in range(4):
                areal.on_rollout_accepted()
        assert c.pull_batch() is not None  # 8 handed out, never acknowledged; 8 queued; 4 + 4 running
        before: dict[str, Any] = c.global_status()["queue"]
    expected = (max(0, areal.get_capacity()), areal.rollout_stat.running, 2)
    assert expected == (8, 8, 2)  # (3 + 2 + 1) * 8 - (16 + 16) - 8
    assert (before["staleness_capacity"], before["running_rollouts"], before["policy_version"]) == expected
    pid = job.controller_pid()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: job.controller_pid() != pid, 30, "a new controller")
    after = wait_for(lambda: _status(job), 30, "the new controller's status")
    assert (after["staleness_capacity"], after["running_rollouts"], after["policy_version"]) == expected
    assert after["unacked_batches"] == 1 and after["queued_sequences"] == 8

    with client(job) as c:  # the trainer goes back to its checkpoint at 2: nothing made past it is delivered
        assert c.set_version(3)["policy_version"] == 3
        for name in ("held-1", "held-2", "queued-3"):
            c.submit_group({**group(name), "worker_id": "0001", "policy_version": 3})
        held = [c.pull_batch() for _ in range(3)]  # (k0, k1) again, (k2, k3), (held-1, held-2): none acknowledged
        assert all(batch is not None for batch in held)
        c.trainer_register()  # the trainer restarts: every unacknowledged batch comes again first
        assert c.set_version(2, recovered=True)["policy_version"] == 2
        pulled = [c.pull_batch() for _ in range(3)]
        assert pulled[2] is None  # the batch made past 2 is settled, the group queued at 3 dropped
        assert [b["batch_id"] for b in pulled[:2] if b is not None] == [b["batch_id"] for b in held[:2] if b]
        handed = sorted(g["id"] for batch in pulled[:2] if batch is not None for g in batch["groups"])
        assert handed == ["k0", "k1", "k2", "k3"]  # the batches made at 2, again with their ids
        queue = c.global_status()["queue"]
        assert queue["dropped_stale_sequences"] == 12 and queue["unacked_batches"] == 2


def _status(job: ControllerJob) -> dict[str, Any] | None:
    from slurm_elastic.errors import SlurmElasticError

    try:
        with client(job) as c:
            queue: dict[str, Any] = c.global_status()["queue"]
            return queue
    except (SlurmElasticError, OSError, KeyError):
        return None
