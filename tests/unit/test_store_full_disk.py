"""A full disk, for real: the store on a 2 MiB tmpfs filled up to the last byte. A pull that
cannot record its hand-out changes nothing (503 material: StoreUnavailableError with a retry
hint); a submit that cannot be made durable is refused and nothing acknowledged is lost; once
space is freed both work again."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore, StoreUnavailableError


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "disk"
    directory.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(directory)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def fill(directory: Path) -> Path:
    """Take every free byte of the filesystem; the file that holds them."""
    filler = directory / "filler"
    chunk = b"\0" * 4096
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0")
        except OSError:
            pass
    return filler


def payload(group_id: str) -> bytes:
    return json.dumps({"id": group_id, "group_size": 4, "pad": "x" * 2000}).encode()


def submit(q: RolloutQueue, group_id: str) -> bool:
    return q.submit(group_id, "0001", 4, 0, payload(group_id))


def test_a_pull_on_a_full_disk_changes_nothing_and_works_once_space_is_freed(small_disk: Path) -> None:
    q = RolloutQueue(RolloutStore(small_disk / "q.sqlite"), QueueConfig(batch_size=8, capacity_seqs=400))
    for i in range(40):
        assert submit(q, f"g{i}")
    before = q.stats()
    filler = fill(small_disk)
    failures = 0
    for _ in range(5):  # each one fails to record its hand-out: nothing may change
        with pytest.raises(StoreUnavailableError) as failed:
            q.pull()
        failures += 1
        assert failed.value.retry_after_s > 0 and ("No space" in str(failed.value) or "full" in str(failed.value))
    stats = q.stats()
    for key in ("queued_sequences", "queued_groups", "unacked_batches", "delivered_sequences"):
        assert stats[key] == before[key], key
    filler.unlink()
    seen: list[str] = []
    while (batch := q.pull()) is not None:
        seen += [json.loads(p)["id"] for p in batch[1]]
        assert q.ack(batch[0]) is True
    assert failures == 5 and seen == [f"g{i}" for i in range(40)]  # in order, none stuck, none twice
    assert q.stats()["delivered_sequences"] == 160 and q.stats()["lost_groups"] == 0
    q.store.close()


def test_a_submit_on_a_full_disk_is_refused_and_nothing_acknowledged_is_lost(small_disk: Path) -> None:
    q = RolloutQueue(RolloutStore(small_disk / "q.sqlite"), QueueConfig(batch_size=8, capacity_seqs=400))
    for i in range(4):
        assert submit(q, f"ok{i}")
    filler = fill(small_disk)
    refused = 0
    for i in range(5):
        try:
            submit(q, f"full{i}")
        except StoreUnavailableError as exc:
            assert "No space left" in str(exc) or "full" in str(exc)
            refused += 1
    assert refused >= 4  # (the first may still fit in a block the log had allocated)
    filler.unlink()
    for i in range(5):
        submit(q, f"full{i}")  # the workers' retries
    assert q.stats()["queued_groups"] == 9
    q.store.close()
    again = RolloutStore(small_disk / "q.sqlite")
    ids = [g.id for g in again.queued()]
    assert sorted(ids) == sorted([f"ok{i}" for i in range(4)] + [f"full{i}" for i in range(5)])
    assert [json.loads(b)["id"] for b in again.hand_out("b", ids, 1.0)] == ids and again.lost() == []
    again.close()
    assert os.path.exists(small_disk / "q.sqlite")
    assert issubclass(StoreUnavailableError, StateFileError)


def test_a_stale_drop_on_a_full_disk_changes_nothing(small_disk: Path) -> None:
    q = RolloutQueue(RolloutStore(small_disk / "q.sqlite"),
                     QueueConfig(batch_size=8, capacity_seqs=400, max_staleness=0))
    for i in range(4):
        assert submit(q, f"old{i}")
    q.set_version(1)
    q.set_version(2)  # all four too stale now (a plain publish steps at most max_staleness + 1); dropped at the next pull
    filler = fill(small_disk)
    with pytest.raises(StoreUnavailableError):
        q.pull()
    assert (q.stats()["queued_sequences"], q.stats()["dropped_stale_sequences"]) == (16, 0)
    filler.unlink()
    assert q.pull() is None
    assert (q.stats()["queued_sequences"], q.stats()["dropped_stale_sequences"]) == (0, 16)
    q.store.close()
    again = RolloutStore(small_disk / "q.sqlite")
    assert again.queued() == [] and again.counts()["dropped"] == 16
    again.close()


def test_a_store_that_cannot_open_on_a_full_disk_says_the_disk_is_full(small_disk: Path) -> None:
    """SQLite says only "disk I/O error" when it cannot make its -wal and -shm files: the message
    names the full disk, and once space is freed the store opens with every group."""
    store = RolloutStore(small_disk / "q.sqlite")
    for i in range(5):
        assert store.insert(f"g{i}", "0001", 4, 0, payload(f"g{i}")) is not None
    store.close()  # a clean close: SQLite removes its -wal and -shm files
    filler = fill(small_disk)
    with pytest.raises(StateFileError, match=r"the disk holding it is full \(\d+ bytes free on .*\): free space"):
        RolloutStore(small_disk / "q.sqlite")
    filler.unlink()
    again = RolloutStore(small_disk / "q.sqlite")
    assert [g.id for g in again.queued()] == [f"g{i}" for i in range(5)]
    again.close()
