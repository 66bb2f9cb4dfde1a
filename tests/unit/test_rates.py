"""The window rate the queue and the simulator share: what it counts and over how long."""

from __future__ import annotations

import pytest

from slurm_elastic.core.rates import WindowRate, per_worker_rate


@pytest.mark.parametrize(("events", "now_s", "expected"), [
    ([], 10.0, None),  # nothing yet
    ([(0.0, 8)], 10.0, None),  # one event in a young series: only where observing began
    ([(0.0, 8), (10.0, 8)], 10.0, 0.8),  # the first marks the start: 8 seqs over 10 s
    ([(0.0, 8), (10.0, 8), (20.0, 8)], 25.0, 16 / 25),  # young series: after the first / since the first
    ([(t, 8) for t in range(0, 100, 10)], 95.0, 48 / 60),  # older than the window: (35, 95] holds 40..90, / 60 s
    ([(0.0, 8)], 60.0, None),  # a lone event is not a rate before the window is full...
    ([(0.0, 8), (30.0, 8)], 70.0, 8 / 60),  # ...and after it, whatever is inside counts over 60 s
    ([(0.0, 8), (10.0, 8)], 200.0, None),  # a silence longer than the window: no estimate
])
def test_window_rate(events: list[tuple[float, float]], now_s: float, expected: float | None) -> None:
    meter = WindowRate(60.0)
    for t, amount in events:
        meter.add(t, amount)
    assert meter.rate(now_s) == (None if expected is None else pytest.approx(expected))


def test_periodic_events_read_their_true_rate_at_any_phase() -> None:
    meter = WindowRate(60.0)
    for step in range(30):
        meter.add(step * 10.0, 64)
    readings = [meter.rate(290.0 + offset) for offset in (0.0, 2.5, 5.0, 9.9)]
    assert readings == [pytest.approx(6.4)] * 4  # the old estimate read 7.47 right after an event


def test_a_new_series_after_a_silence_starts_afresh() -> None:
    meter = WindowRate(60.0)
    meter.add(0.0, 8)
    meter.add(200.0, 8)
    meter.add(210.0, 8)
    assert meter.rate(210.0) == pytest.approx(0.8)


@pytest.mark.parametrize(("production", "busy", "active", "expected"), [
    (6.4, 8.0, 12, 0.8),  # per busy worker: 12 active, 8 generating on average
    (6.4, None, 8, 0.8),  # no busy time reported: per ACTIVE worker
    (6.4, 0.0, 4, 1.6),  # nobody reported busy time yet: per ACTIVE worker
    (None, 8.0, 8, None),  # no production measured
])
def test_per_worker_rate(production: float | None, busy: float | None, active: int, expected: float | None) -> None:
    assert per_worker_rate(production, busy, active) == (None if expected is None else pytest.approx(expected))
