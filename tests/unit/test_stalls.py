"""Recurring stalls: workers back a worker's lead time before a stall like the earlier ones ends."""

from __future__ import annotations

from pathlib import Path

from slurm_elastic.core.scaling import Autoscaler
from slurm_elastic.core.stalls import StallMemory
from slurm_elastic.sim.engine import simulate
from slurm_elastic.sim.output import load_trace
from tests.unit.test_scaling import SLOW, inputs

USUAL = 12.0  # seqs/s: the trainer's usual demand
TRACES = Path(__file__).resolve().parents[2] / "examples" / "traces"


def stall(memory: StallMemory, start_s: float, length_s: float) -> None:
    memory.observe(3.0, USUAL, start_s)
    memory.observe(12.0, USUAL, start_s + length_s)


def test_the_first_stall_is_only_remembered() -> None:
    memory = StallMemory()
    memory.observe(3.0, USUAL, 100.0)
    assert memory.advice(200.0, lead_s=40.0, usual_workers=12.0, current=6) is None
    memory.observe(11.0, USUAL, 250.0)  # back above half the usual demand: it ends
    assert memory.durations_s == [150.0] and memory.since_s is None


def test_a_stall_like_the_last_gets_its_workers_back_a_lead_before_its_end_and_keeps_them() -> None:
    memory = StallMemory()
    stall(memory, 100.0, 150.0)
    memory.observe(3.0, USUAL, 700.0)
    assert memory.advice(700.0 + 109.0, 40.0, 12.0, current=6) is None  # too early
    target, why = memory.advice(700.0 + 110.0, 40.0, 11.8, current=6) or (0, "")
    assert target == 12 and "lasted 150 s" in why and "back to the usual 12 workers before it ends" in why
    held, why = memory.advice(700.0 + 130.0, 40.0, 11.8, current=12) or (0, "")
    assert held is None and why.startswith("hold: workers back for the end of the trainer's stall")
    assert memory.advice(700.0 + 191.0, 40.0, 11.8, current=12) is None  # longer than any: the law decides
    memory.observe(12.0, USUAL, 900.0)
    assert memory.durations_s == [150.0, 200.0] and not memory.restored


def test_stalls_shorter_than_the_lead_are_not_anticipated() -> None:
    """A jittery slow step is no pause worth relaunching for, and a worker shed in one could not be back in time."""
    memory = StallMemory()
    stall(memory, 100.0, 14.0)
    stall(memory, 300.0, 12.0)
    memory.observe(3.0, USUAL, 500.0)
    assert all(memory.advice(500.0 + t, 26.0, 12.0, current=6) is None for t in (0.0, 5.0, 13.0))


def test_without_a_measured_lead_nothing_is_anticipated() -> None:
    memory = StallMemory()
    stall(memory, 100.0, 150.0)
    memory.observe(3.0, USUAL, 700.0)
    assert memory.advice(840.0, None, 12.0, current=6) is None


def test_the_memory_and_the_lead_survive_a_restart_and_damage_is_forgotten() -> None:
    scaler = Autoscaler(SLOW)
    stall(scaler.stalls, 100.0, 150.0)
    scaler.lead_s = 54.0
    again = Autoscaler.from_state(SLOW, scaler.to_state())
    assert again.stalls.durations_s == [150.0] and again.lead_s == 54.0
    damaged = {**scaler.to_state(), "stalls": "garbage", "lead_s": "x"}
    again = Autoscaler.from_state(SLOW, damaged)
    assert again.stalls.durations_s == [] and again.lead_s is None
    assert Autoscaler.from_state(SLOW, {}).lead_s is None  # saved before: no lead, nothing anticipated


def test_a_controller_restarted_during_the_start_up_measures_the_lead_from_the_jobs_first_decision() -> None:
    waiting = inputs(queued=0, active=2, rate=None, consumption=None, trainer_waiting=True, allowed_slots=14)
    scaler = Autoscaler(SLOW)
    scaler.decide(waiting, 100.0)  # the job's first decision
    again = Autoscaler.from_state(SLOW, scaler.to_state())  # restarted at 130 s, nothing measured yet
    again.decide(waiting, 130.0)
    again.decide(inputs(queued=0, active=10, rate=1.2, consumption=None, trainer_waiting=True, allowed_slots=14), 154.0)
    assert again.lead_s == 54.0


def test_checkpoint_stalls_gets_its_workers_back_before_the_third_stall_ends() -> None:
    """The trainer stalls 3x slower for 150 s at 600, 1200 and 1800 s; each relaunched worker loads 45 s."""
    result = simulate(load_trace(TRACES / "checkpoint_stalls.toml"), "ours", 0)
    early = [e for e in result.scale_events if "before it ends" in e.reason]
    assert [e.t_s for e in early] and all(1800 < e.t_s < 1950 for e in early[-1:]), [e.t_s for e in early]
    assert "a new worker takes" in early[-1].reason and early[-1].target > early[-1].before
