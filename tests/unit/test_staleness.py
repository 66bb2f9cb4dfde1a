"""AReaL's capacity cases, table-driven, including recovery after a checkpoint."""

from __future__ import annotations

import pytest

from slurm_elastic.core.staleness import AdmissionGrants, StalenessManager


def manager(**kw: int) -> StalenessManager:
    args = {"batch_size": 4, "max_staleness": 2, "max_concurrent": 1000}
    args.update(kw)
    return StalenessManager(**args)


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ({}, (2 + 0 + 1) * 4),  # initial: (max_staleness + 1) * batch_size = 12
        ({"max_concurrent": 5}, 5),  # concurrency-bound
        ({"running": 3, "max_concurrent": 5}, 2),  # concurrency minus running
        ({"accepted": 10}, 2),  # staleness-bound: 12 - 10
        ({"accepted": 12}, 0),  # exhausted
        ({"accepted": 20}, 0),  # never negative
        ({"version": 1}, 16),  # a version increase frees one batch
        ({"version": 3, "accepted": 10, "running": 4}, (2 + 3 + 1) * 4 - 14),  # mixes
    ],
)
def test_capacity(setup: dict[str, int], expected: int) -> None:
    m = manager()
    for key, value in setup.items():
        setattr(m, key, value)
    assert m.capacity() == expected


def test_submitted_accepted_rejected_hooks() -> None:
    m = manager()
    m.on_submitted(6)
    assert (m.running, m.capacity()) == (6, 6)
    m.on_accepted(4)
    m.on_rejected(2)
    assert (m.running, m.accepted, m.rejected, m.capacity()) == (0, 4, 2, 8)  # rejected ones free capacity


@pytest.mark.parametrize("version", [0, 5, 10, 50])
def test_recovery_to_version_gives_one_window_not_v_more(version: int) -> None:
    m = manager()
    m.on_version_recovered(version)
    assert m.capacity() == (2 + 1) * 4  # (max_staleness + 1) * batch_size, whatever the version


def test_recovery_with_rollouts_in_flight_stays_bounded() -> None:
    m = manager()
    m.on_submitted(3)
    m.on_version_recovered(268)  # the AReaL report: version 268 gave 1084 instead of 12
    assert m.capacity() == 12 - 3


def test_state_round_trip() -> None:
    m = manager()
    m.on_submitted(5)
    m.on_accepted(2)
    m.on_version(3)
    assert StalenessManager.from_state(m.to_state()) == m


def test_bad_parameters() -> None:
    with pytest.raises(ValueError):
        StalenessManager(batch_size=0, max_staleness=1, max_concurrent=1)


def test_unused_admissions_stop_holding_capacity_after_the_ttl() -> None:
    manager = StalenessManager(batch_size=4, max_staleness=0, max_concurrent=100)
    grants = AdmissionGrants(manager, ttl_s=10.0)
    assert grants.grant(3, now_s=0.0) == 3 and grants.grant(3, now_s=1.0) == 1  # capacity 4
    grants.use(2)  # a submit of 2 used the oldest admission in part
    grants.expire(now_s=10.5)  # the first admission is past its ttl: its unused 1 is released
    assert manager.capacity() == 1  # running 4 -> 3 (the queue, not the grants, moves used ones to accepted)
    assert grants.grant(10, now_s=11.5) == 2  # the second admission's unused 1 expired too: running 2
