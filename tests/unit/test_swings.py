"""Swings faster than the response: scale-downs the load soon undoes lengthen the scale-down window."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from slurm_elastic.core.scaling import Autoscaler
from slurm_elastic.core.swings import MAX_SWING_WINDOW_S, SwingMemory
from slurm_elastic.sim.engine import Simulation
from slurm_elastic.sim.output import load_trace
from tests.unit.test_scaling import FAST, inputs

TRACES = Path(__file__).resolve().parents[2] / "examples" / "traces"
WINDOW_S = 120.0


def swing(memory: SwingMemory, down_s: float, up_s: float, last_up_s: float = -1e9) -> None:
    memory.scaled_up(up_s, last_down_s=down_s, last_up_s=last_up_s, starving=True)


def test_one_reversal_teaches_nothing_and_the_second_sets_the_window_to_the_cycle() -> None:
    memory = SwingMemory()
    swing(memory, 200.0, 260.0)
    assert memory.window_s(WINDOW_S, 300.0) == (WINDOW_S, "")
    swing(memory, 480.0, 560.0, last_up_s=260.0)
    window_s, why = memory.window_s(WINDOW_S, 600.0)
    assert window_s == 1.25 * 300.0 and why == "the trainer starved again soon after each of the last 2 scale-downs (a swing every 300 s or less)"


def test_what_is_not_a_swing() -> None:
    memory = SwingMemory()
    swing(memory, 200.0, 260.0)
    memory.scaled_up(560.0, last_down_s=480.0, last_up_s=260.0, starving=False)  # the trainer was fed
    memory.scaled_up(760.0, last_down_s=600.0, last_up_s=260.0, starving=True)  # 160 s after the scale-down
    memory.scaled_up(800.0, last_down_s=480.0, last_up_s=760.0, starving=True)  # a second step up, no scale-down between
    assert memory.at_s == [260.0]


def test_the_window_is_bounded_and_shrinks_back_when_the_swings_stop() -> None:
    memory = SwingMemory()
    swing(memory, 100.0, 150.0)
    swing(memory, 1000.0, 1050.0, last_up_s=150.0)
    assert memory.window_s(WINDOW_S, 1100.0)[0] == MAX_SWING_WINDOW_S
    memory = SwingMemory()
    swing(memory, 200.0, 260.0)
    swing(memory, 480.0, 560.0, last_up_s=260.0)
    assert memory.window_s(WINDOW_S, 560.0 + 600.0)[0] == 375.0
    assert memory.window_s(WINDOW_S, 560.0 + 601.0) == (WINDOW_S, "")  # two cycles without a swing


def test_a_lengthened_window_holds_the_peak_through_a_lull() -> None:
    cfg = dataclasses.replace(FAST, stabilization_window_s=WINDOW_S)
    scaler = Autoscaler(cfg)
    scaler.swings = SwingMemory([0.0, 300.0])  # a 300 s cycle: a 375 s window
    scaler.decide(inputs(queued=0, active=8, consumption=12.0), 300.0)  # the peak asks for ~14
    held = scaler.decide(inputs(queued=640, active=12), 500.0)  # 200 s later the lull asks for far fewer
    assert (held.target_workers, held.action) == (12, "hold"), held.reason
    assert "the stabilization window, lengthened to 375 s because the trainer starved again" in held.reason
    plain = Autoscaler(cfg)
    plain.decide(inputs(queued=0, active=8, consumption=12.0), 300.0)
    assert plain.decide(inputs(queued=640, active=12), 500.0).action == "scale_down"


def test_the_law_records_a_swing_and_a_speed_up_resize_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    scaler = Autoscaler(FAST)
    scaler.decide(inputs(queued=0, active=4, consumption=8.0), 100.0)  # up
    scaler.decide(inputs(queued=640, active=8), 150.0)  # down
    scaler.decide(inputs(queued=0, active=4, consumption=8.0), 200.0)  # up, starving, 50 s after the down
    assert scaler.swings.at_s == [200.0]
    scaler.decide(inputs(queued=640, active=8), 250.0)
    monkeypatch.setattr(scaler, "_speedup", lambda *_: (12, "the trainer sped up"))  # a trainer back from a stall
    assert scaler.decide(inputs(queued=0, active=4, consumption=8.0), 300.0).target_workers == 12
    assert scaler.swings.at_s == [200.0]


def test_the_memory_survives_a_restart_and_damage_is_forgotten() -> None:
    scaler = Autoscaler(FAST)
    scaler.swings = SwingMemory([260.0, 560.0])
    assert Autoscaler.from_state(FAST, scaler.to_state()).swings.at_s == [260.0, 560.0]
    assert Autoscaler.from_state(FAST, {**scaler.to_state(), "swings": "garbage"}).swings.at_s == []
    assert Autoscaler.from_state(FAST, {}).swings.at_s == []  # saved before the rule existed


def test_brief_spikes_holds_its_workers_through_the_lulls() -> None:
    """Rollouts 2.5x longer for 60 s at 250, 610, 880, 1340 and 1590 s: after two reversals the
    scale-downs between spikes wait out the longer window."""
    trace = load_trace(TRACES / "brief_spikes.toml")
    sim = Simulation(trace, "ours", 0)
    sim.start(trace.cluster.initial_workers)
    held_at_s = []
    for t_s in range(2, int(trace.duration_s), 2):
        sim.advance(float(t_s))
        if "window, lengthened to" in sim.state.last_decision.get("reason", ""):
            held_at_s.append(t_s)
    assert held_at_s and min(held_at_s) > 610, held_at_s[:3]  # not before the second spike
