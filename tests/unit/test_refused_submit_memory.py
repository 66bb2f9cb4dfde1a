"""A refused submit (429 full, 409 ahead, stale) frees its body at once: the controller runs with
the cyclic collector all but off (``settle_heap``), so a refusal must not leave a reference cycle
that holds the payload until a collection that may never come."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.refusals import QueueFull, StaleGroup, VersionAhead
from slurm_elastic.rollouts.store import RolloutStore

PAYLOAD_BYTES = 2 << 20
SENDS = 12


@pytest.fixture
def no_cyclic_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


def _queue(tmp: Path, capacity_seqs: int) -> RolloutQueue:
    config = QueueConfig(batch_size=8, capacity_seqs=capacity_seqs, max_staleness=1, max_concurrent=1000,
                         admission_ttl_s=60, fsync="off")
    return RolloutQueue(RolloutStore(tmp / "q.sqlite", fsync="off"), config, clock=lambda: 1000.0)


@pytest.mark.parametrize("why", ["full", "ahead", "stale"])
def test_a_refused_submit_keeps_nothing_of_its_body(tmp_path: Path, no_cyclic_collector: None, why: str) -> None:
    q = _queue(tmp_path, capacity_seqs=4 if why == "full" else 1000)
    version = {"full": 0, "ahead": 5, "stale": 0}[why]
    if why == "stale":
        q.set_version(3, recovered=True)  # a trainer resumed from a checkpoint at 3
    if why == "full":
        assert q.submit("fills", "0001", 4, 0, b"{}")
    expected = {"full": QueueFull, "ahead": VersionAhead, "stale": StaleGroup}[why]
    tracemalloc.start()
    try:
        for i in range(SENDS):
            payload = bytes(PAYLOAD_BYTES)  # a fresh body per send, as each request's is
            with pytest.raises(expected):
                q.submit_then(f"g{i}", "0001", 4, version, payload, lambda *_: None)
            del payload
        held_bytes = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held_bytes < 2 * PAYLOAD_BYTES, f"{held_bytes / 2**20:.0f} MiB still held after {SENDS} refused sends"
