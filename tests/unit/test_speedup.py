"""The speed-up resize: a trainer back from a stall gets its workers back in one step."""

from __future__ import annotations

import dataclasses

from slurm_elastic.core.rates import TrainerSteps
from slurm_elastic.core.scaling import Autoscaler
from slurm_elastic.core.speedup import UsualCount, speedup_resize
from tests.unit.test_scaling import SLOW, inputs

PACE = dict(consumption=12.0, trainer_demand_seqs_per_s=12.0, trainer_latest_demand_seqs_per_s=12.0)
STALL = dict(consumption=3.0, trainer_demand_seqs_per_s=3.0, trainer_latest_demand_seqs_per_s=3.0)


def test_the_last_step_counts_as_soon_as_it_ends_and_a_long_running_one_before() -> None:
    steps = TrainerSteps()
    assert steps.latest_step_s(0.0) is None
    for start_s, length_s in ((0.0, 30.0), (31.0, 30.0), (62.0, 5.0)):
        steps.served(start_s, start_s)
        steps.acked(start_s + length_s, start_s)
        steps.asked(start_s + length_s)
    assert steps.latest_step_s(67.0) == 5.0  # the mean (21.7 s) still shows the slow steps
    assert steps.step_s(67.0) is not None and steps.step_s(67.0) > 20
    steps.served(68.0)
    assert steps.latest_step_s(80.0) == 12.0  # a step in progress longer than the last one


def test_the_usual_count_forgets_slowly_and_a_stall_does_not_pull_it_down() -> None:
    usual = UsualCount(workers=12.0, demand_seqs_per_s=12.0, at_s=0.0)
    usual.observe(3, 3.0, 300.0)  # a stall: a quarter of the usual demand, not folded in
    assert usual.workers == 12.0
    usual.observe(10, 11.0, 600.0)  # the normal pace, with fewer workers: it moves part of the way
    assert 10.0 < usual.workers < 12.0
    assert usual.at_demand(11.5) == usual.workers and usual.at_demand(20.0) is None


def test_a_speedup_after_a_stall_jumps_to_the_usual_count_and_jitter_does_not() -> None:
    usual = UsualCount(workers=12.0, demand_seqs_per_s=12.0, at_s=0.0)
    target, reason = speedup_resize(12.0, [3.0, 3.1, 3.0, 2.9], 1.5, current=4, usual=usual) or (0, "")
    assert target == 12  # 8 for the demand at the measured rate, 12 at this pace before
    assert "the trainer sped up" in reason and "12.0 usually at this pace: back to 12 at once" in reason
    # a fast step among jittery ones: the quartile sits at the usual jitter, not at its lowest
    assert speedup_resize(12.0, [5.0, 11.0, 12.0, 10.0, 12.0, 11.5], 1.5, current=6, usual=usual) is None
    # a count one short of the target is the law's
    assert speedup_resize(12.0, [3.0, 3.0], 1.5, current=11, usual=usual) is None


def test_the_autoscaler_takes_back_a_stalls_scale_down_in_one_step_and_keeps_it() -> None:
    scaler = Autoscaler(dataclasses.replace(SLOW, stabilization_window_s=120.0, max_step_down=8))
    now_s = 0.0
    for now_s in range(0, 600, 10):  # the normal pace with 12 workers: the usual count is 12
        scaler.decide(inputs(queued=64, active=12, **PACE), float(now_s))
    for now_s in range(600, 800, 10):  # a stall: the buffer fills, the law scales down
        d = scaler.decide(inputs(queued=640, active=4, **STALL), float(now_s))
    back = scaler.decide(inputs(queued=640, active=4, consumption=3.0, trainer_demand_seqs_per_s=4.0,
                                trainer_latest_demand_seqs_per_s=12.0), 800.0)
    assert (back.target_workers, back.action) == (12, "scale_up"), back.reason  # no votes, no step cap
    assert "the trainer sped up" in back.reason
    kept = scaler.decide(inputs(queued=640, active=12, consumption=6.0, trainer_demand_seqs_per_s=8.0,
                                trainer_latest_demand_seqs_per_s=12.0), 810.0)
    assert kept.target_workers == 12, kept.reason  # the window keeps the jump while the buffer drains
    assert d.target_workers <= 4


def test_the_usual_count_survives_a_restart() -> None:
    scaler = Autoscaler(SLOW)
    scaler.usual = UsualCount(11.5, 12.0, 590.0)
    again = Autoscaler.from_state(SLOW, scaler.to_state())
    assert again.usual == scaler.usual
    assert Autoscaler.from_state(SLOW, {}).usual is None
