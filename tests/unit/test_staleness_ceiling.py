"""No more workers than the staleness bound lets run a rollout at once: (max_staleness + 1)
batches ÷ the smallest group accepted lately. A worker above that waits at the admission gate
and generates nothing, so the autoscaler neither scales up past it nor keeps workers above it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from slurm_elastic.core.autoscaler_config import AutoscalerConfig
from slurm_elastic.core.rates import GroupSizes
from slurm_elastic.core.scaling import Autoscaler, PressureInputs
from slurm_elastic.core.staleness import rollouts_at_once
from slurm_elastic.core.startup import staleness_ceiling
from slurm_elastic.sim.engine import simulate
from slurm_elastic.sim.output import load_trace
from tests.unit.test_rollout_queue import make, submit

CFG = AutoscalerConfig(min_workers=1, max_workers=40)  # the defaults: votes, cooldowns, a window, step caps


def starved(active: int, **kw: object) -> PressureInputs:
    """A trainer that waits, the bound full: max_staleness 1, batches of 48, groups of 4 (24 rollouts at once)."""
    fields: dict[str, object] = {
        "queued_seqs": 0, "batch_size": 48, "consumption_seqs_per_s": 0.8, "trainer_demand_seqs_per_s": 4.8,
        "per_worker_seqs_per_s": 0.07, "trainer_waiting": True, "in_flight_seqs": 96, "max_staleness": 1,
        "staleness_capacity_seqs": 0, "workers_active": active, "allowed_slots": 40, "smallest_group_seqs": 4,
        **kw}
    return PressureInputs(**fields)  # type: ignore[arg-type]


def test_the_bound_lets_max_staleness_plus_one_batches_run_at_once() -> None:
    assert rollouts_at_once(1, 48, 96, 4) == 24
    assert rollouts_at_once(1, 48, 96, 5) == 20  # 19.2: the twentieth holds what is left
    assert rollouts_at_once(1, 48, 144, 4) == 36  # a trainer's versions ran ahead of its batches: more room
    assert staleness_ceiling(starved(40, smallest_group_seqs=None)) is None  # no group accepted yet
    assert staleness_ceiling(starved(40, max_staleness=None)) is None  # no bound (servers, say)


def test_workers_above_it_are_shed_at_once() -> None:
    """Past every vote, cooldown, stabilization window and step cap: they cannot generate."""
    decision = Autoscaler(CFG).decide(starved(40), 100.0)
    assert (decision.target_workers, decision.action) == (24, "scale_down")
    assert "the staleness bound lets 24 rollouts run at once" in decision.reason, decision.reason


def test_a_starving_trainer_gets_no_worker_past_it() -> None:
    fast = dataclasses.replace(CFG, confirmations=1, scale_up_cooldown_s=0, min_stable_period_s=0, max_step_up=40)
    room_left = {"in_flight_seqs": 40, "staleness_capacity_seqs": 56, "per_worker_seqs_per_s": 0.02}
    decision = Autoscaler(fast).decide(starved(10, **room_left), 100.0)
    assert (decision.target_workers, decision.action) == (24, "scale_up")
    assert "bounded by the staleness bound (24 rollouts at once)" in decision.reason, decision.reason
    at_it = Autoscaler(fast).decide(starved(24, **room_left), 100.0)
    assert (at_it.target_workers, at_it.action) == (24, "hold")
    assert "at the ceiling, the staleness bound (24 rollouts at once)" in at_it.reason, at_it.reason


def test_min_workers_wins_and_without_a_group_nothing_is_capped() -> None:
    floor = Autoscaler(dataclasses.replace(CFG, min_workers=30)).decide(starved(40), 100.0)
    assert floor.target_workers >= 30
    unknown = Autoscaler(CFG).decide(starved(40, smallest_group_seqs=None), 100.0)
    assert unknown.target_workers > 24


def test_the_queue_reports_the_smallest_of_its_last_groups(tmp_path: Path) -> None:
    q = make(tmp_path, capacity_seqs=64)
    assert submit(q, "g0", n=8)
    snapshot = q.snapshot()
    assert snapshot is not None and snapshot.smallest_group_seqs == 8
    assert submit(q, "g1", n=3)
    snapshot = q.snapshot()
    assert snapshot is not None and snapshot.smallest_group_seqs == 3


def test_before_any_group_the_smallest_admission_asked_for_stands_in(tmp_path: Path) -> None:
    """A worker asks for its group's sequences before it starts it: the bound is known a rollout
    earlier than the first group. Groups accepted then decide alone."""
    sizes = GroupSizes()
    sizes.asked(8)
    sizes.asked(6)
    assert sizes.smallest() == 6
    q = make(tmp_path, capacity_seqs=64, max_staleness=3)
    q.admit(8, "0001")
    assert q._group_sizes.smallest() == 8  # the snapshot shows it once the trainer has asked for a batch
    assert submit(q, "g0", n=12)
    snapshot = q.snapshot()
    assert snapshot is not None and snapshot.smallest_group_seqs == 12
    q.admit(2, "0003")  # a rest after a partial grant, once groups are known: changes nothing
    snapshot = q.snapshot()
    assert snapshot is not None and snapshot.smallest_group_seqs == 12


def test_a_simulated_job_whose_bound_binds_holds_no_idle_gpus(tmp_path: Path) -> None:
    """40 GPUs, room for 24 rollouts: the start-up's fill is shed to 24 once groups arrive."""
    trace_path = tmp_path / "bound.toml"
    trace_path.write_text(
        'name = "bound"\nduration_s = 600\n[cluster]\ngpu_slots = 40\nwarmup_s = 20.0\n'
        '[queue]\nbatch_size = 48\ngroup_size = 4\ncapacity_seqs = 256\nmax_staleness = 1\n'
        '[trainer]\nstep_s = 10.0\n[rollout]\ndistribution = "fixed"\nmedian_s = 40.0\n'
        '[autoscaler]\nmax_workers = 40\n')
    result = simulate(load_trace(trace_path), "ours", 0)
    after_fill = [e for e in result.scale_events if e.t_s > 20]
    assert after_fill and all(e.target <= 24 for e in after_fill), after_fill
    assert after_fill[0].t_s < 30, after_fill[0]  # at the first admissions (~21 s), not the first groups (~61 s)
    assert result.metrics["gpu_seconds"] < 24 * 600 + 16 * 80  # the fill's 16 extra for a minute or so
