"""The chaos soak, short form: two rounds of every fault (controller kill -9 mid scale-up, mid drain,
between batch hand-out and ack, and again during the next one's start-up; worker kills; slurmd
restarts; GPU faults), then the invariants (docs/controller.md, "Chaos soak"). Pass/fail depends
on the invariants only; the waits bound a hang, they do not grade speed. It restarts a slurmd of
the session's dev cluster (the job holds every node meanwhile) and leaves every node idle."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from slurm_elastic.devcluster.cluster import DevCluster
from tests.cluster.chaos import (
    FAULT_KINDS,
    ChaosSettings,
    CordonSpan,
    cordon_violations,
    duplicate_step_violations,
    exactly_once_violations,
    fault_schedule,
    run_chaos,
)

pytestmark = pytest.mark.second_cluster


def test_schedule_is_seeded_and_each_round_has_every_fault() -> None:
    def first(seed: int, n: int) -> list[str]:
        schedule = fault_schedule(random.Random(seed), extra=2)
        return [next(schedule).kind for _ in range(n)]
    assert first(3, 16) == first(3, 16)
    assert first(3, 16) != first(4, 16)
    assert set(first(3, len(FAULT_KINDS))) == set(FAULT_KINDS)


def test_exactly_once_flags_loss_duplicates_and_phantoms() -> None:
    assert exactly_once_violations({"a", "b"}, {"a", "b", "c"}, ["a", "b", "c"]) == []  # c: sent, answer lost
    problems = exactly_once_violations({"a", "b"}, {"a", "b"}, ["a", "a", "x"])
    assert problems == ["rollout a delivered 2 times", "rollout b acknowledged (2xx) but never delivered",
                        "rollout x delivered but never sent"]


def test_only_placements_after_a_cordon_count() -> None:
    span = CordonSpan("n1", 2, "health", since_s=100.0, last_seen_s=120.0)
    start = {"worker": "0003", "pid": 9, "node": "n1", "gpus": [2]}
    assert cordon_violations([{**start, "proc_start_t": 100.5}], [span], slack_s=2.0) == []  # placed before it
    assert cordon_violations([{**start, "proc_start_t": 125.0}], [span], slack_s=2.0) == []  # lifted by then
    assert cordon_violations([{**start, "proc_start_t": 119.4}], [span], slack_s=2.0) == []  # within a birth time's error of the lift
    assert cordon_violations([{**start, "proc_start_t": 110.0, "gpus": [1]}], [span], slack_s=2.0) == []
    assert len(cordon_violations([{**start, "proc_start_t": 110.0}], [span], slack_s=2.0)) == 1


def test_duplicate_steps_are_two_at_one_moment() -> None:
    assert duplicate_step_violations([(1.0, ["se-w-0001"]), (2.0, ["se-w-0001"])]) == []
    assert duplicate_step_violations([(1.0, ["se-w-0001", "se-w-0001"])]) == ["2 live se-w-0001 at 1.0"]


@pytest.mark.cluster
def test_chaos_soak_short(devcluster: DevCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = ChaosSettings(seed=int(os.environ.get("CHAOS_SEED", "7")))
    result = run_chaos(devcluster, tmp_path, settings)
    with capsys.disabled():  # the counts belong in every run's log
        print(f"\n{result.summary()}\n{result.details()}")
    assert result.violations == [], "\n".join(result.violations[:30])
    assert result.counts["controller_kills"] >= 3
    assert all(result.counts[kind] >= 1 for kind in FAULT_KINDS)
    assert result.rollouts_checked > 50
