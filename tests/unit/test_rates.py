"""The window rate the queue and the simulator share: what it counts and over how long."""

from __future__ import annotations

import collections

import pytest

from slurm_elastic.core.rates import TrainerSteps, WindowRate, per_worker_rate


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


@pytest.mark.parametrize(("production", "produced", "busy_s", "active", "expected"), [
    (6.4, 768, 960.0, 12, 0.8),  # per busy worker-second: 768 seqs in 120 s, 8 of 12 generating on average
    (6.4, 768, None, 8, 0.8),  # no busy time reported: per ACTIVE worker
    (6.4, 768, 0.0, 4, 1.6),  # nobody reported busy time yet: per ACTIVE worker
    (None, 0, 960.0, 8, None),  # no production measured
])
def test_per_worker_rate(production: float | None, produced: int, busy_s: float | None, active: int,
                         expected: float | None) -> None:
    got = per_worker_rate(production, produced, busy_s, active)
    assert got == (None if expected is None else pytest.approx(expected))


def test_per_worker_rate_takes_production_and_busy_time_over_the_same_span() -> None:
    """Busy time is reported from the first heartbeat, production from the first accepted
    rollout: 20 workers loading a model for 90 s, then each making 12 seqs per 12 s rollout."""
    produced, busy = WindowRate(120.0), WindowRate(120.0)
    for t in range(2, 125, 2):  # heartbeats every 2 s: nothing busy while loading
        busy.add(float(t), 0.0 if t <= 92 else 20 * 2.0)
    for t in range(104, 125, 12):  # every worker hands over one rollout of 12 seqs every 12 s
        produced.add(float(t), 20 * 12)
    own_rates = produced.rate(124.0) / busy.rate(124.0)  # each series over its own age
    same_span = per_worker_rate(produced.rate(124.0), produced.total(124.0), busy.total(124.0), 20)
    assert own_rates > 2.0  # more than twice the truth (1.0: 12 seqs per 12 busy seconds)
    assert 0.7 < same_span <= 1.0  # low, not high: the rollouts in flight have busy time, no sequences yet


def test_trainer_steps_split_the_trainers_cycle_into_waits_and_compute() -> None:
    steps = TrainerSteps(keep=4)
    assert steps.waiting() is None and steps.step_s(0.0) is None and steps.wait_fraction(0.0) is None
    steps.asked(0.0)  # the first ask: waits 30 s for its first batch
    assert steps.waiting() is True
    steps.served(30.0, "b0")
    assert steps.waiting() is False
    steps.acked(39.0, "b0")
    steps.asked(40.0)  # computed 10 s; every poll while it waits is one more ask
    steps.asked(41.0)
    steps.served(45.0, "b1")  # waited 5 s
    assert steps.step_s(45.0) == pytest.approx(10.0)
    assert steps.wait_fraction(45.0) == pytest.approx(35 / 45)
    assert steps.step_s(70.0) == pytest.approx(25.0)  # a step running longer than the mean counts as it runs
    steps.acked(55.0, "b1")
    steps.asked(55.0)
    for start in (55.0, 65.0, 75.0, 85.0):  # four more steps of 10 s, each served at once
        steps.served(start, start)
        steps.acked(start + 10.0, start)
        steps.asked(start + 10.0)
    assert steps.step_s(95.0) == pytest.approx(10.0)
    assert steps.wait_fraction(95.0) == pytest.approx(0.0)  # the last four cycles never waited, the waiting
    # ask at 95 s included as it runs
    assert steps.wait_fraction(105.0) == pytest.approx(10 / 50)


def _cycles(steps: TrainerSteps, events: str, step_s: float = 10.0, wait_s: float = 5.0) -> float:
    """Replay a trainer's calls: S (a batch handed out), K (the oldest held batch acknowledged),
    A (an ask), c (computes ``step_s``), p (a checkpoint of 30 s), w (the supply makes it wait
    ``wait_s``), e (a moment). Returns the time at the end."""
    now_s, handed, held = 0.0, 0, collections.deque[int]()
    for event in events:
        if event == "S":
            steps.served(now_s, handed)
            held.append(handed)
            handed += 1
        elif event == "K":
            steps.acked(now_s, held.popleft())
        elif event == "A":
            steps.asked(now_s)
        now_s += {"c": step_s, "p": 30.0, "w": wait_s, "e": 0.001}.get(event, 0.0)
    return now_s


@pytest.mark.parametrize("pattern, events, per_batch_s", [
    ("acknowledges, then asks", "AS" + "cKAwS" * 6, 10.0),
    ("asks, then acknowledges", "AS" + "cAeKwS" * 6, 10.0),
    ("pulls one ahead, starving", "ASeA" + "cKwSeA" * 6, 10.0),
    ("pulls one ahead, fed", "ASeAS" + "cKAS" * 6, 10.0),
    ("pulls four, updates once, acknowledges four", "A" + ("S" + "eAS" * 3 + "cKKKKAw") * 4, 2.5),
    ("acknowledges four after a checkpoint", "A" + ("S" + "cAwS" * 3 + "cpKKKKAw") * 3, 17.5),
])
def test_the_compute_per_batch_is_its_truth_however_the_trainer_orders_its_calls(
        pattern: str, events: str, per_batch_s: float) -> None:
    steps = TrainerSteps(keep=4)
    end_s = _cycles(steps, events)
    latest = steps.latest_step_s(end_s)
    assert latest is not None and latest == pytest.approx(per_batch_s, abs=0.01), pattern  # never 1 ms
    assert steps.step_s(end_s) == pytest.approx(per_batch_s, abs=0.01), pattern


def test_a_thread_that_acknowledges_each_batch_as_it_arrives_is_not_measured() -> None:
    steps = TrainerSteps(keep=4)  # its calls say nothing of its compute: its consumption is all there is
    end_s = _cycles(steps, "A" + "SeKeAcw" * 8)
    assert steps.latest_step_s(end_s) is None and steps.step_s(end_s) is None


def test_the_waits_of_a_trainer_that_acknowledges_after_its_next_ask_are_its_own() -> None:
    steps = TrainerSteps(keep=4)  # waits 5 s a step, computes 10 s: a third of the time
    end_s = _cycles(steps, "AS" + "cAeKwS" * 6 + "c")
    assert steps.wait_fraction(end_s) == pytest.approx(1 / 3, abs=0.01)


def test_a_batch_handed_out_again_and_acknowledged_at_once_is_no_step() -> None:
    steps = TrainerSteps(keep=4)
    steps.asked(0.0)
    steps.served(1.0, "b1")
    steps.acked(11.0, "b1")
    steps.asked(11.0)  # one step of 10 s
    steps.served(11.0, "b2")
    steps.abandon()  # a new trainer registered while b2 was out; it had consumed b2 already
    steps.served(12.0, "b2", fresh=False)
    steps.acked(12.001, "b2")
    steps.asked(12.002)
    assert steps.latest_step_s(12.002) == pytest.approx(10.0)
    assert steps.waiting() is True
