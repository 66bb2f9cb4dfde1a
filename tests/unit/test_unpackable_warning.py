"""Groups whose sizes can never add up to ``batch_size`` (groups of 3, batches of 8): the trainer
waits with a full-looking buffer, and the controller's log says why once the pulls have found
no batch for a minute (once a minute after). Before, nothing said so."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore


def test_queued_groups_that_never_make_a_batch_are_named_in_the_log(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    q = RolloutQueue(RolloutStore(tmp_path / "q.sqlite", fsync="off"),
                     QueueConfig(batch_size=8, capacity_seqs=100, fsync="off"), clock=lambda: now[0])
    for i in range(4):
        assert q.submit(f"g{i}", "0001", 3, 0, json.dumps({"id": f"g{i}"}).encode())
    with caplog.at_level(logging.WARNING):
        for t in (1000.0, 1030.0, 1059.0):
            now[0] = t
            assert q.pull() is None
        assert "no whole groups" not in caplog.text  # under a minute: it may still come right
        now[0] = 1061.0
        assert q.pull() is None and q.pull() is None
        assert caplog.text.count("no whole groups") == 1
        assert "12 sequences have been queued for 61 s" in caplog.text and "groups queued: 4 x 3" in caplog.text
        assert q.submit("g4", "0001", 2, 0, json.dumps({"id": "g4"}).encode())
        assert q.pull() is not None  # 3 + 3 + 2: a batch again, and the watch starts over
        now[0] = 1200.0
        assert q.pull() is None and caplog.text.count("no whole groups") == 1
