"""Our staleness bound against AReaL's own ``StalenessManager``, side by side, on random
operation sequences (hypothesis stateful testing: a failure shrinks to a minimal sequence).

Ours is the whole path: the rollout queue with its admission leases over the real store on
disk, restarted (closed and opened again from the same directory) at random points. AReaL's
is its class, driven by the same operations through its own callbacks. After every step the
capacity, ``running`` and ``accepted`` agree, where our documented extensions (docs/queue.md,
"Staleness: AReaL's rule and ours") are applied to AReaL's counts explicitly, here:

- a group dropped as stale frees its capacity: ``accepted -= n`` (AReaL has no such call);
- a group already stale when it arrives is refused, and what its worker's lease covered of it is
  released as AReaL's ``on_rollout_rejected``;
- the capacity we report is floored at 0;
- an admission is a lease per worker; one older than the TTL is released as AReaL's
  ``on_rollout_rejected``; a result no open lease covers (late, or never admitted) is accepted
  as a rollout that started and finished at once (``enqueued, submitted, accepted``);
- a recovered trainer finds what is still buffered counted: ``accepted = V * batch_size + buffered``;
  a queued group made past V (by the run it went back from) is dropped at the next pull like a
  stale one (``accepted -= n``);
- a plain version publish may not go back nor jump more than ``max_staleness + 1``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from slurm_elastic.core.staleness import VersionRefused, max_version_step, oldest_fresh_version
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue, StaleGroup
from slurm_elastic.rollouts.store import RolloutStore
from tests.unit.areal_reference import load_staleness_manager

AReaLStalenessManager = load_staleness_manager()
WORKERS = ("0001", "0002", "0003")
TTL_S = 60


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


class Trainer:
    """AReaL's version provider."""

    def __init__(self) -> None:
        self.version = 0

    def get_version(self) -> int:
        return self.version


class Totals:
    """What the runs compared (printed with -s)."""

    steps = restarts = admitted = submitted = refused = 0


class StalenessVsAReaL(RuleBasedStateMachine):
    @initialize(batch=st.sampled_from([4, 8]), max_staleness=st.integers(0, 2), max_concurrent=st.integers(3, 24))
    def start(self, batch: int, max_staleness: int, max_concurrent: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="se-areal-"))
        self.clock = Clock()
        self.config = QueueConfig(batch_size=batch, capacity_seqs=10**6, max_staleness=max_staleness,
                                  max_concurrent=max_concurrent, admission_ttl_s=TTL_S, fsync="off")
        self.queue = RolloutQueue(RolloutStore(self.dir / "rollouts.sqlite", fsync="off"), self.config,
                                  clock=self.clock)
        self.trainer = Trainer()
        self.areal = AReaLStalenessManager(self.trainer, max_concurrent, batch, max_staleness)
        self.leases: dict[str, tuple[int, float]] = {}  # worker -> (unused, granted at)
        self.queued: dict[str, tuple[int, int]] = {}  # group id -> (sequences, version)
        self.unacked: dict[str, list[tuple[int, int]]] = {}  # batch id -> its groups (size, version), pull order
        self.rehand: list[str] = []  # handed out again first, in pull order (after a trainer or controller restart)
        self.dropped_seqs = 0
        self.groups = 0

    def teardown(self) -> None:
        if hasattr(self, "queue"):
            self.queue.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # ---- the model of our extensions, applied to AReaL's class ---------------------------------
    def expire(self) -> None:
        for worker, (unused, granted_at) in list(self.leases.items()):
            if self.clock.t - granted_at > TTL_S:
                del self.leases[worker]
                for _ in range(unused):
                    self.areal.on_rollout_rejected()

    def areal_capacity(self) -> int:
        return max(0, int(self.areal.get_capacity()))

    # ---- rules -------------------------------------------------------------------------------
    @rule(worker=st.sampled_from(WORKERS), wanted=st.integers(1, 12))
    def admit(self, worker: str, wanted: int) -> None:
        self.expire()
        expected = min(wanted, self.areal_capacity())
        assert self.queue.admit(wanted, worker) == expected
        for _ in range(expected):
            self.areal.on_rollout_enqueued()
            self.areal.on_rollout_submitted()
        if expected:
            self.leases[worker] = (self.leases.get(worker, (0, 0.0))[0] + expected, self.clock.t)
        Totals.admitted += expected

    @rule(worker=st.sampled_from(WORKERS), size=st.integers(1, 4), age=st.integers(0, 3))
    def submit(self, worker: str, size: int, age: int) -> None:
        self.expire()
        version = max(0, self.trainer.version - age)
        self.groups += 1
        group_id = f"g{self.groups}"
        body = json.dumps({"id": group_id, "group_size": size, "policy_version": version}).encode()
        unused, granted_at = self.leases.get(worker, (0, 0.0))
        used = min(size, unused)
        if version < oldest_fresh_version(self.trainer.version, self.config.max_staleness):
            with pytest.raises(StaleGroup):
                self.queue.submit(group_id, worker, size, version, body)
            for _ in range(used):  # extension: refused on arrival, its lease released
                self.areal.on_rollout_rejected()
            Totals.refused += size
        else:
            assert self.queue.submit(group_id, worker, size, version, body)
            for _ in range(used):
                self.areal.on_rollout_accepted()
            for _ in range(size - used):  # not covered by a lease: started and finished at once
                self.areal.on_rollout_enqueued()
                self.areal.on_rollout_submitted()
                self.areal.on_rollout_accepted()
            self.queued[group_id] = (size, version)
            Totals.submitted += size
        if unused - used:
            self.leases[worker] = (unused - used, granted_at)
        else:
            self.leases.pop(worker, None)

    @rule()
    def pull(self) -> None:
        got = self.queue.pull()
        while self.rehand:  # handed out again first, without groups made past the version
            batch_id = self.rehand.pop(0)
            kept = [(n, v) for n, v in self.unacked[batch_id] if v <= self.trainer.version]
            for size, version in self.unacked[batch_id]:
                if version > self.trainer.version:  # made past the version the trainer resumed at
                    self.dropped_seqs += size
                    self.areal.rollout_stat.accepted -= size  # extension: a dropped group frees capacity
            if kept:
                self.unacked[batch_id] = kept
                assert got is not None and got[0] == batch_id
                assert self.queue.stats()["dropped_stale_sequences"] == self.dropped_seqs
                return
            del self.unacked[batch_id]  # nothing left of it: the queue settles it
        oldest_ok = oldest_fresh_version(self.trainer.version, self.config.max_staleness)
        for group_id, (size, version) in list(self.queued.items()):
            if version < oldest_ok or version > self.trainer.version:
                del self.queued[group_id]
                self.dropped_seqs += size
                self.areal.rollout_stat.accepted -= size  # extension: a dropped group frees capacity
        assert self.queue.stats()["dropped_stale_sequences"] == self.dropped_seqs
        if got is not None:
            batch_id, payloads = got
            ids = [json.loads(p)["id"] for p in payloads]
            assert sum(self.queued[i][0] for i in ids) == self.config.batch_size
            self.unacked[batch_id] = [self.queued[i] for i in ids]
            for group_id in ids:
                del self.queued[group_id]

    @precondition(lambda self: self.unacked)
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        batch_id = data.draw(st.sampled_from(sorted(self.unacked)))
        assert self.queue.ack(batch_id)
        del self.unacked[batch_id]
        if batch_id in self.rehand:
            self.rehand.remove(batch_id)

    @rule(step=st.integers(-1, 4))
    def publish(self, step: int) -> None:
        version = self.trainer.version + step
        if 0 <= step <= max_version_step(self.config.max_staleness):
            self.queue.set_version(version)
            self.trainer.version = version
        elif version >= 0:
            with pytest.raises(VersionRefused, match="recovered=true"):
                self.queue.set_version(version)

    @rule(version=st.integers(0, 12))
    def publish_recovered(self, version: int) -> None:
        self.queue.set_version(version, recovered=True)
        self.trainer.version = version
        self.areal.on_version_recovered(version)
        buffered = sum(n for n, _v in self.queued.values()) + sum(n for groups in self.unacked.values() for n, _v in groups)
        self.areal.rollout_stat.accepted += buffered  # extension: the buffer survives the trainer

    @rule()
    def trainer_restart(self) -> None:
        self.queue.trainer_restarted()
        self.rehand = list(self.unacked)

    @rule(store_too=st.sampled_from([False, False, False, True]))
    def controller_restart(self, store_too: bool) -> None:
        """The queue rebuilt from what the store holds; with ``store_too`` the store is closed
        and opened again as well (a new process would do both; the store's own recovery costs a
        new syncer process, so most runs rebuild the queue alone)."""
        store = self.queue.store
        if store_too:
            store.close()
            store = RolloutStore(store.path, fsync="off")
        self.queue = RolloutQueue(store, self.config, clock=self.clock)
        self.rehand = list(self.unacked)
        Totals.restarts += 1

    @rule(seconds=st.sampled_from([1, 20, 45, TTL_S + 1, 5 * TTL_S]))
    def time_passes(self, seconds: int) -> None:
        self.clock.t += seconds

    # ---- the check -----------------------------------------------------------------------------
    @invariant()
    def same_counts_as_areal(self) -> None:
        Totals.steps += 1
        self.expire()
        stats = self.queue.stats()
        assert stats["policy_version"] == self.trainer.version
        ours = (stats["staleness_capacity"], self.queue.staleness.running, self.queue.staleness.accepted)
        theirs = (self.areal_capacity(), self.areal.rollout_stat.running, self.areal.rollout_stat.accepted)
        assert ours == theirs


EXAMPLES = int(os.environ.get("SLURM_ELASTIC_AREAL_EXAMPLES", "300"))  # more for a long run
StalenessVsAReaL.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_staleness_matches_areal = StalenessVsAReaL.TestCase


@pytest.mark.parametrize("restart", ["trainer", "controller"])
def test_a_batch_held_across_a_resume_to_an_earlier_checkpoint_matches_areal(restart: str) -> None:
    """The sequence the random runs rarely reach, spelled out through the same machine: a batch
    handed out at version 3, the trainer resumed at 1, the batch handed again without what was
    made past 1 (partly, then wholly), with AReaL's counts after every step."""
    machine = StalenessVsAReaL()
    machine.start(batch=4, max_staleness=2, max_concurrent=24)
    try:
        for step in (1, 1):
            machine.publish(step=step)
            machine.same_counts_as_areal()
        machine.admit(worker="0001", wanted=12)
        for size, age in ((2, 1), (2, 0), (4, 0)):  # groups at versions 1, 2, 2
            machine.submit(worker="0001", size=size, age=age)
        machine.pull()
        machine.pull()  # two batches held: (v1, v2) and (v2)
        machine.publish(step=1)  # version 3
        machine.trainer_restart() if restart == "trainer" else machine.controller_restart(store_too=True)
        machine.publish_recovered(version=1)
        machine.same_counts_as_areal()
        for _ in range(3):
            machine.pull()
            machine.same_counts_as_areal()
        assert machine.dropped_seqs == 6 and machine.queue.stats()["dropped_stale_sequences"] == 6
    finally:
        machine.teardown()


CHILD = """
import json, sys, time
from pathlib import Path
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore
q = RolloutQueue(RolloutStore(Path(sys.argv[1])), QueueConfig(**json.loads(sys.argv[2])), clock=lambda: 1000.0)
def submit(group_id, worker, n, version):
    q.submit(group_id, worker, n, version, json.dumps({"id": group_id}).encode())
q.set_version(3, recovered=True)
assert q.admit(8, "0001") == 8 and q.admit(4, "0002") == 4  # 0002 dies mid-rollout
for i in range(4):
    submit(f"a{i}", "0001", 2, 3)
assert q.pull() is not None  # 4 handed out, never acknowledged
assert q.admit(6, "0001") == 6
submit("b", "0001", 2, 3)  # 4 of 0001's admission still running
submit("c", "0003", 2, 3)  # never admitted
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("after_s", [10, TTL_S + 1])
def test_a_controller_killed_with_groups_buffered_and_admissions_in_flight(tmp_path: Path, after_s: int) -> None:
    """kill -9 of a process that owns the queue; the queue opened again holds AReaL's counts
    (with the dead worker's lease still held inside the TTL, released after it)."""
    import signal
    import subprocess
    import sys

    config = {"batch_size": 4, "max_staleness": 4, "max_concurrent": 100, "admission_ttl_s": TTL_S}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "rollouts.sqlite"), json.dumps(config)],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    trainer = Trainer()
    areal = AReaLStalenessManager(trainer, 100, 4, 4)
    trainer.version = 3
    areal.on_version_recovered(3)
    for _ in range(8 + 4 + 6):
        areal.on_rollout_enqueued()
        areal.on_rollout_submitted()
    for _ in range(8 + 2):
        areal.on_rollout_accepted()  # 0001's groups a0..a3 and b
    for _ in range(2):  # c: not admitted, started and finished at once
        areal.on_rollout_enqueued()
        areal.on_rollout_submitted()
        areal.on_rollout_accepted()
    if after_s > TTL_S:
        for _ in range(4 + 4):  # 0002's lease and the rest of 0001's
            areal.on_rollout_rejected()
    clock = Clock()
    clock.t = 1000.0 + after_s
    queue = RolloutQueue(RolloutStore(tmp_path / "rollouts.sqlite"), QueueConfig(**config), clock=clock)  # type: ignore[arg-type]
    try:
        stats = queue.stats()
        assert (stats["staleness_capacity"], stats["running_rollouts"], queue.staleness.accepted) == (
            max(0, areal.get_capacity()), areal.rollout_stat.running, areal.rollout_stat.accepted)
        assert stats["unacked_batches"] == 1 and stats["queued_sequences"] == 8 and stats["policy_version"] == 3
    finally:
        queue.store.close()
