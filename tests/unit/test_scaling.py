"""The autoscaler policy, table by table. Time is passed in; nothing sleeps."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from slurm_elastic.core.autoscaler_config import AutoscalerConfig
from slurm_elastic.core.cordons import CordonBook
from slurm_elastic.core.reconcile import ReconcileConfig
from slurm_elastic.core.scaling import (
    RESUME_SETTLE_S,
    Autoscaler,
    PressureInputs,
    effective_setpoint_seqs,
)
from slurm_elastic.core.tick import ControlState, Observation, TickConfig, desired_workers, tick
from slurm_elastic.errors import ConfigError

FAST = AutoscalerConfig(min_workers=1, max_workers=16, confirmations=1, scale_up_cooldown_s=0,
                        scale_down_cooldown_s=0, min_stable_period_s=0, stabilization_window_s=0,
                        max_step_up=16, max_step_down=16, ki=0.0, kd=0.0)


def inputs(queued: float | None = 64, active: int = 4, rate: float | None = 1.0, consumption: float | None = 4.0,
           **kw: object) -> PressureInputs:
    return PressureInputs(queued_seqs=queued, batch_size=32, consumption_seqs_per_s=consumption,
                          per_worker_seqs_per_s=rate, workers_active=active, **kw)  # type: ignore[arg-type]


def decide(cfg: AutoscalerConfig, x: PressureInputs, now_s: float = 100.0) -> tuple[int, str, str]:
    d = Autoscaler(cfg).decide(x, now_s)
    return d.target_workers, d.action, d.reason


@pytest.mark.parametrize(
    ("queued", "expected_action", "phrase"),
    [
        (0, "scale_up", "trainer starving"),  # empty buffer: more workers
        (64, "hold", "deadband"),  # at the setpoint (2 batches x 32): feed-forward 4 = current 4
        (640, "scale_down", "buffer above setpoint"),  # far above: fewer (the DEO code scaled UP here)
    ],
)
def test_direction(queued: float, expected_action: str, phrase: str) -> None:
    _target, action, reason = decide(FAST, inputs(queued=queued))
    assert action == expected_action and phrase in reason


def test_staleness_bound_and_full_buffer_never_scale_up() -> None:
    target, action, reason = decide(FAST, inputs(queued=0, staleness_capacity_seqs=0))
    assert (target, action) == (3, "scale_down") and "staleness bound" in reason
    target, action, reason = decide(FAST, inputs(queued=100, buffer_capacity_seqs=100))
    assert (target, action) == (3, "scale_down") and "buffer full" in reason


def test_no_scale_down_while_the_trainer_waits_with_the_buffer_below_its_setpoint() -> None:
    """A starved trainer's consumption reads as low demand: after an operator's `resume` from a
    manual count too low, the law asked for fewer workers while the trainer waited (an operator's
    probe: "scale_down: trainer starving")."""
    starved = inputs(queued=16, active=3, rate=8.57, consumption=7.36, trainer_demand_seqs_per_s=31.6)
    _target, action, _reason = decide(FAST, starved)
    assert action == "scale_down"  # the trainer not seen waiting: the law as it is
    target, action, reason = decide(FAST, dataclasses.replace(starved, trainer_waiting=True))
    assert (target, action) == (3, "hold") and reason.startswith("hold: no scale-down while the trainer waits")
    target, action, reason = decide(FAST, dataclasses.replace(starved, trainer_waiting=True, staleness_capacity_seqs=0))
    assert action == "scale_down" and "staleness bound" in reason  # a bound still sheds
    assert "no rollout starts until it publishes its next policy version" in reason  # and says why it is stuck


def test_a_bound_reached_with_a_batch_buffered_says_nothing_of_publishing() -> None:
    """Only a trainer that waits with less than a batch buffered is stuck on its next publish (a
    live audit: a trainer that published every 2 batches with max_staleness 1 stopped for good)."""
    _target, _action, reason = decide(FAST, inputs(queued=40, trainer_waiting=True, staleness_capacity_seqs=0))
    assert "staleness bound" in reason and "publishes" not in reason


def test_the_stabilization_window_remembers_the_calls_for_more_made_at_the_ceiling() -> None:
    """Found by a live audit of servers: while the count sat at max_workers, the calls for more were
    not put in the window, so a pause right after a long load shed at once, not a window later."""
    scaler = Autoscaler(dataclasses.replace(FAST, max_workers=4, stabilization_window_s=60))
    for t in range(0, 101, 2):
        assert scaler.decide(inputs(queued=0, active=4), t).action == "hold"  # at the ceiling
    held = scaler.decide(inputs(queued=640, active=4), 102)
    assert held.action == "hold" and "stabilization window" in held.reason
    assert scaler.decide(inputs(queued=640, active=4), 161).action == "scale_down"


def test_confirmations_in_a_row() -> None:
    scaler = Autoscaler(dataclasses.replace(FAST, confirmations=3))
    actions = [scaler.decide(inputs(queued=0), t).action for t in (1, 2, 3)]
    assert actions == ["hold", "hold", "scale_up"]
    scaler.decide(inputs(queued=640), 4)  # a vote the other way resets the count
    assert scaler.decide(inputs(queued=0), 5).reason.startswith("hold: up vote 1/3")


@pytest.mark.parametrize(("queued", "cooldown_field"), [(0, "scale_up_cooldown_s"), (640, "scale_down_cooldown_s")])
def test_each_cooldown(queued: float, cooldown_field: str) -> None:
    scaler = Autoscaler(dataclasses.replace(FAST, **{cooldown_field: 30.0}, max_step_up=1, max_step_down=1))
    first = scaler.decide(inputs(queued=queued), 0.0)
    assert first.action != "hold"
    held = scaler.decide(inputs(queued=queued, active=first.target_workers), 10.0)
    assert held.action == "hold" and "cooldown" in held.reason
    assert scaler.decide(inputs(queued=queued, active=first.target_workers), 31.0).action == first.action


def test_min_stable_period() -> None:
    scaler = Autoscaler(dataclasses.replace(FAST, min_stable_period_s=10.0))
    assert "not stable" in scaler.decide(inputs(queued=0), 0.0).reason
    assert scaler.decide(inputs(queued=0), 5.0).action == "hold"
    assert scaler.decide(inputs(queued=0), 10.0).action == "scale_up"


def test_stabilization_window_acts_on_the_highest_recent_recommendation() -> None:
    scaler = Autoscaler(dataclasses.replace(FAST, stabilization_window_s=60.0))
    scaler.decide(inputs(queued=0, active=8, consumption=12.0), 0.0)  # recommends ~14 at t=0
    late = scaler.decide(inputs(queued=640, active=8), 30.0)  # now recommends far fewer
    assert (late.target_workers, late.action) == (8, "hold")  # the window keeps 8, never more
    assert "stabilization window" in late.reason
    after = scaler.decide(inputs(queued=640, active=8), 100.0)  # the high one has left the window
    assert after.action == "scale_down"


def test_step_caps() -> None:
    target, action, reason = decide(dataclasses.replace(FAST, max_step_up=2), inputs(queued=0, active=1))
    assert (target, action) == (3, "scale_up") and "step capped" in reason
    target, _a, _r = decide(dataclasses.replace(FAST, max_step_down=1), inputs(queued=6400, active=10))
    assert target == 9


@pytest.mark.parametrize(("queued", "active", "slots", "expected"),
                         [(0, 16, 100, 16), (0, 5, 5, 5), (6400, 1, 9, 1), (0, 2, 100, 16)])
def test_min_max_and_gpu_slots(queued: float, active: int, slots: int, expected: int) -> None:
    x = inputs(queued=queued, active=active, allowed_slots=slots, consumption=40.0)  # needs ~42 workers
    target, _action, _reason = decide(FAST, x)
    assert target == expected


def test_pending_workers_count_and_draining_do_not() -> None:
    # 4 active + 4 starting already cover the need: no more launches
    target, action, _ = decide(FAST, inputs(queued=64, active=4, workers_starting=4, consumption=8.0))
    assert (target, action) == (8, "hold")
    # draining ones are not capacity: 4 active (+3 draining) at a need of 4 is a hold, not a scale-down
    target, action, _ = decide(FAST, inputs(queued=64, active=4, workers_draining=3))
    assert (target, action) == (4, "hold")


def test_anti_windup_after_a_long_saturation() -> None:
    cfg = dataclasses.replace(FAST, ki=0.05, max_workers=4)
    scaler = Autoscaler(cfg)
    for t in range(0, 3600, 10):  # an hour starving at the maximum
        scaler.decide(inputs(queued=0, active=4), float(t))
    assert scaler.integral == 0.0  # did not wind up while pinned at max_workers
    recovered = scaler.decide(inputs(queued=640, active=4), 3600.0)
    assert recovered.action == "scale_down"  # reacts at once when the buffer fills


@pytest.mark.parametrize("queued", [None, math.nan])
def test_no_buffer_measurement_holds(queued: float | None) -> None:
    target, action, reason = decide(FAST, inputs(queued=queued))
    assert (target, action) == (4, "hold") and "nothing to measure yet" in reason


def test_no_rate_measured_yet_starts_the_ramp() -> None:
    target, action, reason = decide(FAST, inputs(queued=0, rate=None, active=0))
    assert (target, action) == (1, "scale_up") and "start-up" in reason
    target, action, reason = decide(FAST, inputs(queued=640, rate=math.nan))
    assert (target, action) == (4, "hold") and "no production rate" in reason


def test_server_load_source_and_how_sources_combine() -> None:
    cfg = dataclasses.replace(FAST, requests_per_worker_capacity=8, scale_up_threshold=0.8)
    # 4 servers, 64 outstanding: ratio 2.0 -> ceil(64 / 6.4) = 10 servers, beats the buffer's hold
    target, action, reason = decide(cfg, inputs(queued=64, outstanding_requests=64))
    assert (target, action) == (10, "scale_up") and "load ratio 2.00 above" in reason
    # load within the band: the buffer source decides
    _t, action, reason = decide(cfg, inputs(queued=0, outstanding_requests=20))
    assert action == "scale_up" and "trainer starving" in reason
    # idle servers and no rollout buffer: scale down to what the load needs
    target, action, _ = decide(cfg, PressureInputs(queued_seqs=None, batch_size=32, workers_active=6,
                                                   outstanding_requests=4))
    assert (target, action) == (1, "scale_down")


def test_verl_knob_names_are_accepted() -> None:
    cfg = AutoscalerConfig.from_mapping({"min_workers": 2, "max_workers": 8, "scale_up_cooldown": 30.0,
                                         "scale_down_cooldown": 60, "min_stable_period": 10.0,
                                         "enable_elastic": True, "requests_per_worker_capacity": 10,
                                         "scale_up_threshold": 0.8, "scale_down_threshold": 0.4})
    assert (cfg.scale_up_cooldown_s, cfg.min_stable_period_s, cfg.enabled) == (30.0, 10.0, True)


@pytest.mark.parametrize(("key", "instead"), [
    ("monitoring_interval", "controller.tick_interval_s"), ("monitoring_interval_s", "controller.tick_interval_s"),
    ("drain_timeout", "workers.drain_timeout_s"), ("drain_timeout_s", "workers.drain_timeout_s"),
])
def test_verl_knobs_another_key_holds_are_refused_naming_that_key(key: str, instead: str) -> None:
    with pytest.raises(ConfigError, match=rf"autoscaler\.{key}: .*{instead}"):
        AutoscalerConfig.from_mapping({key: 5.0})


@pytest.mark.parametrize(("data", "message"), [
    ({"max_worker": 3}, "autoscaler.max_worker: unknown key"),
    ({"min_workers": "2"}, "autoscaler.min_workers: must be an integer"),
    ({"kp": -1.0}, "autoscaler.kp: must be >= 0"),
    ({"min_workers": 5, "max_workers": 2}, "min_workers"),
    ({"setpoint_batches": 0.5, "setpoint_floor_batches": 0.75},
     r"autoscaler.setpoint_floor_batches \(0.75\) > setpoint_batches \(0.5\)"),
    ({"scale_up_cooldown": 1.0, "scale_up_cooldown_s": 2.0},
     r"autoscaler.scale_up_cooldown_s: given twice \(also as autoscaler.scale_up_cooldown\)"),
    ({"scale_up_cooldown_s": 2.0, "scale_up_cooldown": 1.0},
     r"autoscaler.scale_up_cooldown: given twice \(also as autoscaler.scale_up_cooldown_s\)"),
])
def test_config_errors_name_the_key(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AutoscalerConfig.from_mapping(data)


def test_a_setpoint_below_the_default_floor_lowers_the_floor_with_it() -> None:
    assert AutoscalerConfig.from_mapping({"setpoint_batches": 0.5}).setpoint_floor_batches == 0.5


def test_state_round_trip_keeps_the_memory() -> None:
    scaler = Autoscaler(dataclasses.replace(FAST, ki=0.05, confirmations=3))
    for t in (0.0, 10.0):
        scaler.decide(inputs(queued=0), t)
    restored = Autoscaler.from_state(scaler.config, scaler.to_state())
    assert restored.to_state() == scaler.to_state()
    restored.resuming = False  # past the settling a restart holds (below)
    scaler.skip_integration()  # a restart integrates nothing over the time down
    assert restored.decide(inputs(queued=0), 20.0) == scaler.decide(inputs(queued=0), 20.0)


def test_time_the_autoscaler_does_not_decide_in_is_not_integrated_over() -> None:
    """An operator's target, a pause, wake-all or the drain before the time limit: the autoscaler
    does not decide, and its integral must not gather the error meanwhile (an operator's probe:
    `I 128` after 100 s at a manual count of 1, driving the count up once resumed)."""
    scaler = Autoscaler(dataclasses.replace(FAST, ki=0.05))
    scaler.decide(inputs(queued=0), 0.0)
    scaler.decide(inputs(queued=0), 10.0)
    gathered = scaler.integral
    assert gathered > 0
    for t in range(20, 111, 10):
        scaler.not_deciding(float(t))
    scaler.decide(inputs(queued=0), 110.0)
    assert scaler.integral == gathered
    scaler.decide(inputs(queued=0), 120.0)
    assert scaler.integral == 2 * gathered  # 10 s more, as from 0 to 10


def test_a_manual_target_pause_or_wake_all_leaves_the_integral_alone_through_the_tick() -> None:
    for how in ({"manual_target": 1}, {"paused": True}, {"wake_all_active": True}):
        state = ControlState(autoscaler=Autoscaler(dataclasses.replace(FAST, ki=0.05)), cordons=CordonBook(), **how)
        state.autoscaler.decide(inputs(queued=0), 0.0)
        assert state.autoscaler.last_now_s == 0.0
        desired_workers(state, Observation(steps=()), 8, TickConfig(reconcile=ReconcileConfig()), 50.0)
        assert state.autoscaler.last_now_s is None, how


def test_a_restarted_controller_holds_until_its_rates_are_measured_again() -> None:
    """Its rate windows start again from nothing: a per-worker rate from two heartbeats or a
    demand of 0 must not scale the running pool."""
    scaler = Autoscaler(FAST)
    scaler.decide(inputs(queued=0, active=4), 0.0)
    assert scaler.ramped
    restored = Autoscaler.from_state(FAST, json.loads(json.dumps(scaler.to_state())))
    garbage = inputs(queued=500, active=4, rate=100.0, consumption=0.01)  # would shed workers at once
    held = restored.decide(garbage, 1000.0)
    assert (held.action, held.target_workers) == ("hold", 4) and "restarted 0 s ago" in held.reason
    assert restored.decide(garbage, 1000.0 + RESUME_SETTLE_S - 1).action == "hold"
    assert "restarted" not in restored.decide(garbage, 1000.0 + RESUME_SETTLE_S).reason  # the law decides again


def test_a_restarts_settling_time_runs_from_its_first_tick_decided_in_or_not() -> None:
    """A restarted controller held at an operator's target: its settling time runs from its first
    tick, not from the first decision after `resume` (an operator's probe read "restarted 0 s ago"
    from a controller up 39 s)."""
    scaler = Autoscaler(FAST)
    scaler.decide(inputs(queued=0, active=4), 0.0)
    restored = Autoscaler.from_state(FAST, json.loads(json.dumps(scaler.to_state())))
    restored.not_deciding(1000.0)
    assert "restarted 10 s ago" in restored.decide(inputs(queued=64, active=4), 1010.0).reason
    again = Autoscaler.from_state(FAST, json.loads(json.dumps(scaler.to_state())))
    again.not_deciding(1000.0)
    assert "restarted" not in again.decide(inputs(queued=64, active=4), 1000.0 + RESUME_SETTLE_S).reason


@pytest.mark.parametrize(("deadband", "consumption", "expected_action"), [
    (0.5, 4.4, "hold"),  # recommends ~4.4 vs 4: inside a 0.5 deadband
    (0.5, 5.0, "scale_up"),  # ~5.0 vs 4: outside it
    (1.5, 5.0, "hold"),  # a wider deadband holds the same difference
])
def test_deadband(deadband: float, consumption: float, expected_action: str) -> None:
    cfg = dataclasses.replace(FAST, deadband_workers=deadband)
    _target, action, _reason = decide(cfg, inputs(queued=64, consumption=consumption))
    assert action == expected_action


@pytest.mark.parametrize(("x", "expected_action", "phrase"), [
    (PressureInputs(queued_seqs=0, batch_size=0, workers_active=4), "hold", "nothing to measure yet"),  # empty
    (inputs(queued=64, consumption=math.nan), "scale_down", "feed-forward 0.00"),  # NaN consumption: no feed-forward
    (inputs(queued=64, consumption=None), "scale_down", "feed-forward 0.00"),
    (inputs(queued=0, rate=math.inf), "scale_up", "start-up: no trainer has asked for rollouts yet, doubling 4 -> 8"),
])
def test_unmeasured_inputs_are_explicit(x: PressureInputs, expected_action: str, phrase: str) -> None:
    _target, action, reason = decide(FAST, x)
    assert action == expected_action and phrase in reason


@pytest.mark.parametrize(("max_staleness", "in_flight", "expected_seqs"), [
    (None, 40.0, 64.0),  # no bound given: setpoint_batches x batch_size (2 x 32)
    (4, 0.0, 64.0),  # room (4 - 1/2) x 32 = 112 is above the setpoint: the setpoint holds
    (2, 8.0, 40.0),  # room (2 - 1/2) x 32 - 8 = 40: lowered to what the bound lets the buffer hold
    (2, 40.0, 24.0),  # room 8 is below the floor: 3/4 batch, half (the least that feeds every pull) + margin
    (1, 0.0, 24.0),
])
def test_effective_setpoint_respects_the_staleness_room(max_staleness: int | None, in_flight: float,
                                                         expected_seqs: float) -> None:
    x = inputs(max_staleness=max_staleness, in_flight_seqs=in_flight)
    assert effective_setpoint_seqs(FAST, x) == expected_seqs


def test_a_buffer_at_the_staleness_room_reads_as_a_surplus() -> None:
    # 16 sequences in flight with max_staleness 2: the buffer cannot average 2 batches (64); at 48
    # queued the old setpoint read "starving", the room (1.5 x 32 - 16 = 32) reads a surplus
    x = inputs(queued=48, active=8, consumption=4.0, max_staleness=2, in_flight_seqs=16.0)
    target, action, reason = decide(FAST, x)
    assert action == "scale_down" and target < 8 and "32 aimed for" in reason


def test_the_integral_does_not_grow_while_a_cooldown_holds_the_move_back() -> None:
    cfg = dataclasses.replace(FAST, ki=0.05, scale_down_cooldown_s=600.0, max_step_down=1)
    scaler = Autoscaler(cfg)
    scaler.decide(inputs(queued=640, active=10), 0.0)  # acts: one worker fewer, then the cooldown
    before = scaler.integral
    for t in range(10, 300, 10):  # the buffer stays above the setpoint; the cooldown holds the move
        assert scaler.decide(inputs(queued=640, active=9), float(t)).action == "hold"
    assert scaler.integral == before  # no windup to overshoot with once the cooldown ends


STARVING = "although the trainer waits for rollouts"


def test_a_hold_while_the_trainer_starves_names_the_cooldown_and_the_time_left() -> None:
    scaler = Autoscaler(dataclasses.replace(FAST, scale_up_cooldown_s=30.0, max_step_up=1))
    assert scaler.decide(inputs(queued=0), 0.0).action == "scale_up"
    held = scaler.decide(inputs(queued=0, active=5), 18.0)
    assert held.action == "hold"
    assert held.reason.startswith(f"hold: cooldown after scale-up (12 s left of scale_up_cooldown_s 30 s) {STARVING}")


@pytest.mark.parametrize(("cfg", "x", "words"), [
    # recommends ~4.4 for 4: the deadband, named with its width
    (dataclasses.replace(FAST, deadband_workers=0.5), inputs(queued=60, consumption=4.3),
     f"within the deadband (0.5 worker) of the current 4 {STARVING}"),
    (dataclasses.replace(FAST, confirmations=2), inputs(queued=0),
     f"waiting for 2 readings in a row that ask for more workers (confirmations) {STARVING}"),
    (dataclasses.replace(FAST, min_stable_period_s=10.0), inputs(queued=0),
     f"not stable yet, it has held 0 s of the 10 s required (min_stable_period_s) {STARVING}"),
    (dataclasses.replace(FAST, max_workers=4), inputs(queued=0), f"at the ceiling, max_workers (4) {STARVING}"),
    (FAST, inputs(queued=0, allowed_slots=4), f"at the ceiling, the usable GPU slots (4) {STARVING}"),
])
def test_every_hold_while_the_trainer_starves_says_why_in_words(cfg: AutoscalerConfig, x: PressureInputs,
                                                                words: str) -> None:
    target, action, reason = decide(cfg, x)
    assert (target, action) == (4, "hold")
    assert reason.startswith("hold: ") and words in reason
    assert "trainer starving: the buffer holds" in reason  # and the pressure itself, in numbers


def test_a_hold_with_a_surplus_does_not_claim_the_trainer_waits() -> None:
    _t, action, reason = decide(dataclasses.replace(FAST, confirmations=2), inputs(queued=640))
    assert action == "hold" and "down vote 1/2" in reason and STARVING not in reason


def test_a_capped_step_names_the_cap() -> None:
    _t, action, reason = decide(dataclasses.replace(FAST, max_step_up=2), inputs(queued=0, active=1))
    assert action == "scale_up" and "step capped at max_step_up 2" in reason


SLOW = dataclasses.replace(FAST, confirmations=2, min_stable_period_s=10.0, scale_up_cooldown_s=30.0, max_step_up=1)


def test_start_up_fills_the_jobs_gpus_while_the_trainer_waits_then_one_sizing_step_sheds_them() -> None:
    scaler = Autoscaler(SLOW)
    waiting = inputs(queued=0, active=2, rate=None, consumption=None, trainer_waiting=True, allowed_slots=14,
                     burst_slots=4)
    first = scaler.decide(waiting, 2.0)  # no votes, no stable period, no step cap; burst slots not asked for
    assert (first.target_workers, first.action) == (10, "scale_up")
    assert "a worker on every GPU the job holds -> 10 workers" in first.reason
    more = Autoscaler(SLOW).decide(dataclasses.replace(waiting, workers_active=12), 2.0)  # burst workers already
    assert more.target_workers == 12  # never fewer before anything is measured
    full = dataclasses.replace(waiting, queued_seqs=96, workers_active=10, per_worker_seqs_per_s=0.8,
                               staleness_capacity_seqs=0)
    held = scaler.decide(full, 40.0)  # full before the trainer's demand is known: no shedding one by one
    assert held.action == "hold" and "holding until the trainer's demand is measured" in held.reason
    measured = dataclasses.replace(full, trainer_waiting=False, trainer_demand_seqs_per_s=3.2)
    sized = scaler.decide(measured, 50.0)  # 3.2 seqs/s at 0.8 per worker: 4, in one step down from 10
    assert (sized.target_workers, sized.action) == (4, "scale_down") and "start-up ends" in sized.reason
    assert scaler.window == []  # the start-up's counts are not recommendations the window holds on to
    after = scaler.decide(dataclasses.replace(measured, workers_active=4, staleness_capacity_seqs=None, queued_seqs=8),
                          90.0)
    assert "start-up" not in after.reason and "feed-forward" in after.reason


def test_start_up_doubles_once_per_cooldown_before_a_trainer_has_asked() -> None:
    scaler = Autoscaler(SLOW)
    first = scaler.decide(inputs(queued=0, active=2, rate=None, consumption=None), 2.0)
    assert (first.target_workers, first.action) == (4, "scale_up") and "doubling 2 -> 4" in first.reason
    held = scaler.decide(inputs(queued=0, active=4, rate=0.8, consumption=None), 20.0)
    assert held.action == "hold" and "cooldown after scale-up" in held.reason
    second = scaler.decide(inputs(queued=8, active=4, rate=0.8, consumption=None), 32.0)
    assert second.target_workers == 8


def test_a_policy_whose_first_look_is_measured_steers_at_once() -> None:
    d = Autoscaler(SLOW).decide(inputs(queued=8, active=8, rate=0.8, consumption=6.4), 70.0)
    assert "start-up" not in d.reason and "feed-forward" in d.reason


def test_workers_still_loading_count_for_what_they_will_add() -> None:
    """A Smith predictor for the model load: the workers the last decision launched are not
    asked for again while they load."""
    x = inputs(queued=0, active=6, rate=1.0, consumption=4.0)
    without = Autoscaler(FAST).decide(x, 100.0)
    loading = Autoscaler(FAST).decide(dataclasses.replace(x, workers_loading=2), 100.0)
    assert loading.recommended is not None and without.recommended is not None
    # 2 loading workers at 1 seq/s over the 30 s horizon: 60 seqs of the error are on their way
    assert without.recommended - loading.recommended == pytest.approx(2.0)
    assert "2 workers still loading count for 60 seqs of it" in loading.reason
    assert loading.error_seqs == without.error_seqs  # the buffer's error itself is what it is


def test_start_up_ramp_ends_for_the_job_once_measured_and_a_restart_does_not_start_it_again() -> None:
    scaler = Autoscaler(SLOW)
    scaler.decide(inputs(queued=8, active=8, rate=0.8, consumption=6.4), 2.0)  # the rates measured once
    restarted = Autoscaler.from_state(SLOW, json.loads(json.dumps(scaler.to_state())))  # as state.json keeps it
    after = restarted.decide(inputs(queued=0, active=8, rate=None, consumption=None), 100.0)  # rates lost
    assert after.action == "hold" and "start-up" not in after.reason  # no doubling of a running pool
    mid_ramp = Autoscaler.from_state(SLOW, Autoscaler(SLOW).to_state())  # killed before any measurement
    assert "doubling 2 -> 4" in mid_ramp.decide(inputs(queued=0, active=2, rate=None, consumption=None), 2.0).reason
    assert Autoscaler.from_state(SLOW, {}).ramped  # memory saved before the ramp existed: a running job


def test_start_up_sizes_the_first_step_from_the_known_demand_and_production() -> None:
    cfg = dataclasses.replace(SLOW, startup_trainer_step_s=10.0, startup_worker_seqs_per_s=0.8)
    d = Autoscaler(cfg).decide(inputs(queued=0, active=1, rate=None, consumption=None), 2.0)
    # demand 32 seqs / 10 s = 3.2 seqs/s; 0.8 per worker -> 4 workers in one step
    assert (d.target_workers, d.action) == (4, "scale_up")
    assert "needs 3.20 seqs/s (startup_trainer_step_s)" in d.reason and "(startup_worker_seqs_per_s)" in d.reason


def test_start_up_is_held_to_the_staleness_room_and_stops_at_the_setpoint() -> None:
    # max_staleness 1: (1 + 1) x 32 - 8 queued = 56 seqs may be out before a pull; 4 workers hold 32: 8 each
    x = inputs(queued=8, active=4, rate=None, consumption=None, max_staleness=1, in_flight_seqs=32.0)
    d = Autoscaler(dataclasses.replace(FAST, max_step_up=1)).decide(x, 2.0)
    assert d.target_workers == 7 and "held to 7 by the staleness room" in d.reason
    full = Autoscaler(FAST).decide(inputs(queued=640, active=4, rate=None, consumption=None), 2.0)
    assert full.action != "scale_up" and "start-up" not in full.reason


def test_a_full_staleness_bound_sheds_down_to_what_the_trainers_demand_needs() -> None:
    # the trainer computes 8 s per batch of 32 (4 seqs/s); a worker makes 1 seq/s: 4 workers feed it
    x = inputs(queued=0, active=10, staleness_capacity_seqs=0, trainer_demand_seqs_per_s=4.0)
    target, action, reason = decide(FAST, x)
    assert (target, action) == (4, "scale_down")
    assert "4.00 for the trainer's demand 4.00 seqs/s at 1.00 per worker" in reason
    # a demand that needs more than one fewer: one fewer, as without a measured demand
    target, _action, reason = decide(FAST, inputs(queued=0, active=10, staleness_capacity_seqs=0,
                                                  trainer_demand_seqs_per_s=12.0))
    assert target == 9 and reason.endswith("fewer workers")


def test_the_stabilization_window_follows_the_trainers_demand() -> None:
    scaler = Autoscaler(dataclasses.replace(FAST, stabilization_window_s=120.0))
    busy = inputs(queued=0, active=8, consumption=12.0, trainer_demand_seqs_per_s=12.0)
    high = scaler.decide(busy, 0.0).recommended
    assert high is not None and high > 8
    # 30 s later the trainer computes three times as long per step (an evaluation): a third the demand
    slow = inputs(queued=640, active=8, consumption=4.0, trainer_demand_seqs_per_s=4.0)
    late = scaler.decide(slow, 30.0)
    assert late.action == "scale_down"  # the window keeps high x 4/12 (< 8), not high
    assert late.target_workers < 8
    # without a measured demand the window keeps the highest recommendation as it was
    plain = Autoscaler(dataclasses.replace(FAST, stabilization_window_s=120.0))
    plain.decide(inputs(queued=0, active=8, consumption=12.0), 0.0)
    held = plain.decide(inputs(queued=640, active=8, consumption=4.0), 30.0)
    assert (held.target_workers, held.action) == (8, "hold") and "stabilization window" in held.reason


def test_the_start_up_holds_while_the_trainer_computes_and_ends_on_its_step_time() -> None:
    scaler = Autoscaler(SLOW)
    waiting = inputs(queued=0, active=4, rate=None, consumption=None, trainer_waiting=True, allowed_slots=8)
    assert scaler.decide(waiting, 2.0).target_workers == 8  # the trainer waits: every GPU
    computing = dataclasses.replace(waiting, workers_active=8, trainer_waiting=False)
    d = scaler.decide(computing, 20.0)
    assert (d.target_workers, d.action) == (8, "hold") and "the trainer computes" in d.reason
    # its step time measured (32 seqs per 8 s = 4 seqs/s) and a worker's production (0.8): the
    # start-up is over before the trainer has pulled twice, and the pool is sized to 5
    measured = dataclasses.replace(computing, per_worker_seqs_per_s=0.8, trainer_demand_seqs_per_s=4.0)
    d = scaler.decide(measured, 40.0)
    assert (d.target_workers, d.action) == (5, "scale_down")
    assert "the trainer needs 4.00 seqs/s, a worker makes 0.80 (both measured) -> 5 workers" in d.reason


def test_a_window_saved_before_it_kept_the_demand_still_loads() -> None:
    state = Autoscaler(FAST).to_state()
    state["window"] = [[10.0, 6.0]]  # the earlier form: (time, recommendation)
    restored = Autoscaler.from_state(FAST, state)
    assert restored.window == [(10.0, 6.0, None)]


def test_a_scale_up_stopped_by_max_workers_says_so() -> None:
    cfg = dataclasses.replace(FAST, max_workers=6)
    target, action, reason = decide(cfg, inputs(queued=0, active=2, consumption=20.0, allowed_slots=16))
    assert (target, action) == (6, "scale_up") and reason.endswith("(bounded by max_workers (6))")
    _target, _action, free = decide(FAST, inputs(queued=0, active=2, consumption=8.0, allowed_slots=16))
    assert "bounded" not in free


def test_back_from_an_operators_count_with_the_trainer_waiting_the_pool_is_sized_to_its_demand_at_once() -> None:
    """`scale J 1`, then `resume`: a starved trainer's consumption is what the one worker makes, so
    the law alone climbed back 1 -> 5 over two minutes (an operator's probe). Its measured demand
    over a worker's production sizes the pool at once, once; not while the start-up runs, and not
    when the trainer does not wait."""
    slow = dataclasses.replace(FAST, confirmations=3, scale_up_cooldown_s=60, max_step_up=1)
    scaler = Autoscaler(slow)
    scaler.decide(inputs(queued=64, active=4), 0.0)
    assert scaler.ramped
    starved = inputs(queued=0, active=1, rate=11.0, consumption=11.0, trainer_demand_seqs_per_s=96.0,
                     trainer_waiting=True)
    for t in range(10, 110, 10):
        scaler.not_deciding(float(t))
    back = scaler.decide(starved, 110.0)
    assert (back.action, back.target_workers) == ("scale_up", 9), back.reason
    assert "back from a count the autoscaler did not set" in back.reason
    assert scaler.decide(starved, 115.0).action == "hold"  # once: the law (votes, cooldown) goes on from there

    fed = Autoscaler(slow)
    fed.decide(inputs(queued=64, active=4), 0.0)
    fed.not_deciding(10.0)
    assert "back from" not in fed.decide(dataclasses.replace(starved, trainer_waiting=False), 20.0).reason


def test_an_operators_count_taken_before_the_start_up_sized_the_pool_is_left_at_the_trainers_demand() -> None:
    """`scale J 99` while the job started, `scale J 0`, `resume` (an operator's probe of a live job):
    the start-up's sizing step never came, the resize back was spent on a decision with no worker
    producing, and the law climbed 1 -> 2 in 40 s with the trainer waiting 90% of its steps."""
    slow = dataclasses.replace(FAST, confirmations=3, scale_up_cooldown_s=60, max_step_up=1)
    scaler = Autoscaler(slow)
    for t in range(0, 10):
        scaler.not_deciding(float(t))
    # the workers the operator drained measured a worker's production; none runs now
    starved = inputs(queued=0, active=0, rate=11.0, consumption=11.0, trainer_demand_seqs_per_s=96.0,
                     trainer_waiting=True)
    back = scaler.decide(starved, 10.0)
    assert (back.action, back.target_workers) == ("scale_up", 9), back.reason

    ramped = Autoscaler(slow)  # after the start-up: back from `scale J 0`, no worker has made anything yet
    ramped.decide(inputs(queued=64, active=4), 0.0)
    ramped.not_deciding(10.0)
    ramped.decide(dataclasses.replace(starved, per_worker_seqs_per_s=None, workers_active=1), 20.0)
    assert ramped.returning  # not spent on a decision that could not tell
    back = ramped.decide(dataclasses.replace(starved, workers_active=1), 30.0)
    assert (back.action, back.target_workers) == ("scale_up", 9), back.reason
    assert "back from a count the autoscaler did not set" in back.reason and not scaler.returning


def test_a_start_up_that_runs_after_an_operators_count_ends_with_its_own_sizing_step() -> None:
    fresh = Autoscaler(FAST)
    fresh.not_deciding(0.0)
    fresh.starting = True  # a start-up under way
    sized = fresh.decide(inputs(queued=0, active=1, rate=11.0, consumption=11.0, trainer_demand_seqs_per_s=96.0,
                                trainer_waiting=True), 10.0)
    assert fresh.ramped and "back from" not in sized.reason, sized.reason


def test_a_cooldown_delays_the_resize_back_from_an_operators_count_and_does_not_cancel_it() -> None:
    slow = dataclasses.replace(FAST, confirmations=3, scale_up_cooldown_s=60, max_step_up=1)
    scaler = Autoscaler(slow)
    scaler.decide(inputs(queued=64, active=4), 0.0)
    scaler.last_up_s = 90.0  # its own scale-up shortly before the operator's `scale J 1`
    starved = inputs(queued=0, active=1, rate=11.0, consumption=11.0, trainer_demand_seqs_per_s=96.0,
                     trainer_waiting=True)
    for t in (100.0, 110.0):
        scaler.not_deciding(t)
    assert "cooldown" in scaler.decide(starved, 120.0).reason
    back = scaler.decide(starved, 150.0)
    assert (back.action, back.target_workers) == ("scale_up", 9), back.reason


def test_a_suspended_job_is_not_integrated_over() -> None:
    state = ControlState(autoscaler=Autoscaler(dataclasses.replace(FAST, ki=0.05)), cordons=CordonBook())
    state.autoscaler.decide(inputs(queued=0), 0.0)
    tick(Observation(steps=None, paused_s=60.0), state, TickConfig(reconcile=ReconcileConfig()), (), 70.0)
    assert state.autoscaler.last_now_s is None
