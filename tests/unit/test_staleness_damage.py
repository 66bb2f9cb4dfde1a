"""Saved staleness counts that are readable but impossible: the counts they give at open (a
negative ``accepted``, fewer accepted than buffered, an arrival the store never held) are damage,
refused at open like negative saved fields, and never written back (live audit: ``gross_seqs``
edited to 0 after 100 sequences were dropped opened as capacity 1012 where the bound allows 32)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from slurm_elastic.core.staleness import AdmissionLeases, Lease, StalenessManager
from slurm_elastic.core.staleness_snapshot import StalenessSnapshot
from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore

CONFIG = QueueConfig(batch_size=8, capacity_seqs=1000, max_staleness=3, max_concurrent=1024, admission_ttl_s=600,
                     fsync="off")
BOUND = (CONFIG.max_staleness + 1) * CONFIG.batch_size  # 32: the most a resume with an empty buffer leaves


def open_queue(tmp: Path) -> RolloutQueue:
    store = RolloutStore(tmp / "q.sqlite", fsync="off")
    try:
        return RolloutQueue(store, CONFIG, clock=lambda: 1000.0)
    except BaseException:
        store.close()
        raise


def submit(q: RolloutQueue, group_id: str, worker_id: str, n: int, version: int) -> None:
    body = json.dumps({"id": group_id, "group_size": n, "policy_version": version,
                       "sequences": [{"tokens": [1], "score": 1.0}] * n}).encode()
    assert q.submit(group_id, worker_id, n, version, body)


def saved(tmp: Path) -> dict[str, object]:
    with sqlite3.connect(tmp / "q.sqlite") as db:
        return dict(json.loads(db.execute("SELECT value FROM meta WHERE key = 'staleness'").fetchone()[0]))


def edit(tmp: Path, **fields: object) -> None:
    with sqlite3.connect(tmp / "q.sqlite") as db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'staleness'", (json.dumps({**saved(tmp), **fields}),))


def audited_store(tmp: Path) -> None:
    """The audit's store: 100 sequences dropped as stale, a resume at version 204, a 4-sequence
    group admitted (saved) and then stored (after the saved counts)."""
    q = open_queue(tmp)
    for i in range(25):
        submit(q, f"old{i}", "0001", 4, 0)
    q.set_version(4)
    q.set_version(8)
    assert q.pull() is None  # every group is older than 8 - 3: all dropped
    assert q.stats()["dropped_stale_sequences"] == 100
    q.set_version(204, recovered=True)
    assert q.admit(4, "0002") == 4
    submit(q, "new", "0002", 4, 204)
    assert (q.stats()["staleness_capacity"], q.stats()["running_rollouts"]) == (BOUND - 4, 0)
    q.store.close()


def test_the_audits_store_opens_with_its_counts_before_the_edit(tmp_path: Path) -> None:
    audited_store(tmp_path)
    q = open_queue(tmp_path)
    assert (q.stats()["staleness_capacity"], q.staleness.accepted, q.staleness.running) == (BOUND - 4, 204 * 8 + 4, 0)
    q.store.close()


def test_a_gross_count_edited_to_0_after_drops_is_refused_and_not_written_back(tmp_path: Path) -> None:
    audited_store(tmp_path)
    edit(tmp_path, gross_seqs=0)  # accepted would open as 0 + 4 - 100 = -96: capacity 1024, bound 32
    for _ in range(2):  # a restarted controller is refused again: nothing saved over the damage
        with pytest.raises(StateFileError, match=r"staleness counts .*damaged: gross_seqs 0 \+ 4 arrived since "
                                                 r"- 100 dropped or lost gives accepted -96, below 0.*from a copy"):
            open_queue(tmp_path)
        assert saved(tmp_path)["gross_seqs"] == 0


@pytest.mark.parametrize(("damage", "named"), [
    ({"gross_seqs": 100}, r"accepted 4, below the 8 sequences still buffered"),  # 8 queued, 4 of them after the save
    ({"at_seq": 99}, r"at_seq 99 is past the last arrival stored, 27"),
    ({"version": 2**63}, r"version 9223372036854775808 is past 9223372036854775807"),
], ids=["accepted-below-buffered", "at-seq", "version"])
def test_saved_counts_that_no_queue_could_have_are_refused(tmp_path: Path, damage: dict[str, int],
                                                          named: str) -> None:
    q = open_queue(tmp_path)
    for i in range(25):
        submit(q, f"old{i}", "0001", 4, 0)
    q.set_version(4)
    assert q.pull() is None  # 100 dropped
    submit(q, "a", "0001", 4, 4)  # seq 26 ...
    q.set_version(5)  # ... saved with it
    submit(q, "b", "0001", 4, 5)  # seq 27, after the save
    q.store.close()
    edit(tmp_path, **damage)
    with pytest.raises(StateFileError, match=named):
        open_queue(tmp_path)
    assert {k: saved(tmp_path)[k] for k in damage} == damage  # left as it was


def test_a_snapshot_with_impossible_counts_restores_nothing() -> None:
    manager = StalenessManager(batch_size=8, max_staleness=3, max_concurrent=1024, version=7, accepted=60, running=4)
    leases = AdmissionLeases(manager, ttl_s=600.0, leases={"a": Lease(4, 0.0)})
    with pytest.raises(ValueError, match=r"accepted -96, below 0"):
        StalenessSnapshot(204, 0, 25, {}).restore(leases, {"b": 4}, dropped_seqs=100, buffered_seqs=4, last_seq=26)
    with pytest.raises(ValueError, match=r"lease of b holds -5"):
        StalenessSnapshot(1, 8, 0, {"b": Lease(-5, 0.0)}).restore(leases, {}, dropped_seqs=0)
    assert (manager.version, manager.accepted, manager.running, leases.leases) == (7, 60, 4, {"a": Lease(4, 0.0)})


def test_a_resume_to_an_early_checkpoint_after_many_deliveries_is_not_damage() -> None:
    """accepted may fall far below everything ever delivered (a resume at V anchors it at
    V·batch_size plus the buffer), never below the buffer itself."""
    manager = StalenessManager(batch_size=8, max_staleness=3, max_concurrent=1024)
    leases = AdmissionLeases(manager, ttl_s=600.0)
    resumed_at_2 = StalenessSnapshot(2, 2 * 8 + 12 + 300, 140, {})  # 500 delivered before; 12 buffered, 300 dropped
    resumed_at_2.restore(leases, {}, dropped_seqs=300, buffered_seqs=12, last_seq=140)
    assert (manager.accepted, manager.capacity()) == (28, (3 + 2 + 1) * 8 - 28)
