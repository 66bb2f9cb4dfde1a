"""AReaL's capacity cases, table-driven, including recovery after a checkpoint."""

from __future__ import annotations

import pytest

from slurm_elastic.core.staleness import (
    AdmissionLeases,
    Lease,
    StalenessManager,
    VersionRefused,
    oldest_fresh_version,
)
from slurm_elastic.core.staleness_snapshot import StalenessSnapshot


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


def test_bad_parameters() -> None:
    with pytest.raises(ValueError):
        StalenessManager(batch_size=0, max_staleness=1, max_concurrent=1)


def test_recovery_counts_what_is_still_buffered() -> None:
    m = manager()
    m.on_version_recovered(10, buffered_seqs=8)  # 8 sequences wait for the trainer: they go first
    assert m.capacity() == 12 - 8


@pytest.mark.parametrize(("current", "new", "allowed"), [
    (5, 5, True), (5, 6, True), (5, 8, True),  # the same (a retry), one step, max_staleness + 1 = 3
    (5, 4, False), (5, 9, False), (0, 10**30, False), (0, 2**63, False),
])
def test_a_plain_publish_may_not_go_back_or_jump_past_the_bound(current: int, new: int, allowed: bool) -> None:
    m = manager(version=current)
    if allowed:
        m.on_version(new)
        assert m.version == new
    else:
        with pytest.raises(VersionRefused, match=r"recovered=true|outside"):
            m.on_version(new)
        assert m.version == current


def test_a_recovered_publish_may_go_anywhere_the_store_can_hold() -> None:
    m = manager(version=50)
    m.on_version_recovered(3)
    assert (m.version, m.accepted) == (3, 12)
    with pytest.raises(VersionRefused):
        m.on_version_recovered(2**63)


def test_leases_are_per_worker_and_expire_after_the_ttl() -> None:
    m = StalenessManager(batch_size=4, max_staleness=0, max_concurrent=100)
    leases = AdmissionLeases(m, ttl_s=10.0)
    assert leases.grant("a", 3, now_s=0.0) == 3 and leases.grant("b", 3, now_s=5.0) == 1  # capacity 4
    assert leases.accept("b", 1, now_s=6.0) == 1  # b's submit uses b's lease, not a's older one
    assert (m.running, m.accepted) == (3, 1)
    leases.expire(now_s=10.5)  # a died: its 3 are released; b has nothing left open
    assert (m.running, m.capacity(), leases.leases) == (0, 3, {})


class _CountedScans(dict[str, Lease]):
    """The leases, counting how often all of them are gone through."""

    scans = 0

    def items(self):  # type: ignore[no-untyped-def]
        self.scans += 1
        return super().items()


def test_expiry_scans_the_leases_only_when_one_may_be_old_and_at_most_once_a_second() -> None:
    m = StalenessManager(batch_size=4, max_staleness=0, max_concurrent=100)
    counted = _CountedScans()
    leases = AdmissionLeases(m, ttl_s=10.0, leases=counted)
    assert leases.grant("a", 2, now_s=0.0, admission_id="x") == 2
    assert leases.grant("b", 2, now_s=0.5, admission_id="y") == 2
    for i in range(5000):  # a client asking under ever new worker ids, at no capacity
        assert leases.grant(f"spam{i}", 1, now_s=1.0 + i * 1e-4, admission_id=f"s{i}") == 0
    assert counted.scans == 0  # no lease could be past its TTL
    assert leases.expire(now_s=10.2) == 2 and "a" not in counted and counted.scans == 1
    assert leases.expire(now_s=10.6) == 0 and counted.scans == 1  # b is due, the last scan was 0.4 s ago
    assert leases.expire(now_s=11.2) == 2 and "b" not in counted and counted.scans == 2
    for i in range(100):  # the spam's leases fall due one after another: one scan a second
        leases.expire(now_s=11.2 + i * 0.01)
    assert counted.scans == 2 and leases.expire(now_s=12.3) == 0 and counted.scans == 3
    assert m.running == 0 and len(counted) == 0


def test_a_late_or_unadmitted_result_never_takes_from_running_twice() -> None:
    m = StalenessManager(batch_size=8, max_staleness=0, max_concurrent=100)
    leases = AdmissionLeases(m, ttl_s=10.0)
    leases.grant("a", 4, now_s=0.0)
    leases.grant("b", 4, now_s=0.0)
    assert leases.accept("c", 4, now_s=1.0) == 0  # nobody admitted c: accepted, running untouched
    assert (m.running, m.accepted) == (8, 4)
    assert leases.accept("a", 4, now_s=11.0) == 0  # a's result after its lease expired (released first)
    leases.expire(now_s=11.0)
    assert (m.running, m.accepted, m.capacity()) == (0, 8, 0)


def test_restored_leases_lose_what_their_workers_handed_over_since() -> None:
    m = StalenessManager(batch_size=8, max_staleness=1, max_concurrent=100)
    leases = AdmissionLeases(m, ttl_s=10.0)
    leases.restore({"a": Lease(4, 0.0), "b": Lease(4, 1.0)}, {"a": 4, "b": 1, "c": 8})
    assert leases.leases == {"b": Lease(3, 1.0)} and m.running == 3


def test_the_drop_rule() -> None:
    assert oldest_fresh_version(10, 2) == 8 and oldest_fresh_version(0, 4) == -4


def test_a_snapshot_restores_the_counts_moved_on_by_what_arrived_and_was_dropped() -> None:
    m = StalenessManager(batch_size=8, max_staleness=1, max_concurrent=100)
    leases = AdmissionLeases(m, ttl_s=60.0)
    leases.grant("a", 6, now_s=0.0)
    leases.accept("a", 2, now_s=1.0)
    m.on_version(1)
    saved = StalenessSnapshot.from_json(StalenessSnapshot.take(leases, dropped_seqs=4, at_seq=10).to_json())
    leases.accept("a", 3, now_s=2.0)  # after the snapshot: group 11 (3 of a's) and 12 (4, unadmitted)
    leases.accept("b", 4, now_s=2.0)
    m.on_dropped(2)  # and 2 more dropped
    again = AdmissionLeases(StalenessManager(batch_size=8, max_staleness=1, max_concurrent=100), ttl_s=60.0)
    saved.restore(again, {"a": 3, "b": 4}, dropped_seqs=6)
    counts = [(s.version, s.accepted, s.running, s.capacity()) for s in (again.staleness, m)]
    assert counts[0] == counts[1] and again.leases == leases.leases  # (the rejected/submitted tallies restart)


@pytest.mark.parametrize("text", ["", "[]", "{}", '{"version":1,"gross_seqs":0,"at_seq":0,"leases":{"a":[1]}}',
                                  '{"version":"x","gross_seqs":0,"at_seq":0,"leases":{}}'])
def test_a_damaged_snapshot_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        StalenessSnapshot.from_json(text)
