"""CordonBook: hysteresis, operator and crash cordons, pre-flight, unknown nodes, state."""

from __future__ import annotations

import json

import pytest

from slurm_elastic.core.cordons import CordonBook
from slurm_elastic.core.health import AgentReport, GpuSample, HealthRules

RULES = HealthRules(healthy_period_s=100.0, agent_silence_s=30.0, crash_cordon_s=1000.0)


def gpu(index: int = 0, node: str = "n1", **kw: object) -> GpuSample:
    base: dict[str, object] = dict(
        node=node,
        index=index,
        uuid=f"GPU-{node}-{index}",
        temperature_c=50.0,
        clock_event_reasons=frozenset(),
        memory_used_mb=1000,
        memory_total_mb=80000,
    )
    base.update(kw)
    return GpuSample(**base)  # type: ignore[arg-type]


HOT = {"clock_event_reasons": frozenset({"hw_thermal_slowdown"})}


def test_health_cordon_and_hysteresis() -> None:
    book = CordonBook(RULES)
    assert book.observe([gpu(0), gpu(1)], 0.0) == []
    changes = book.observe([gpu(0, **HOT), gpu(1)], 10.0)
    assert [(c.gpu, c.action, c.source, c.drain) for c in changes] == [
        (0, "cordon", "health", True)
    ]
    assert book.cordoned()[("n1", 0)].reason == "hw_thermal_slowdown"
    assert book.cordoned()[("n1", 0)].since_s == 10.0
    assert book.drain_targets() == {("n1", 0)}
    # healthy again, but not for long enough; a relapse restarts the period
    book.observe([gpu(0), gpu(1)], 20.0)
    book.observe([gpu(0), gpu(1)], 110.0)
    assert ("n1", 0) in book.cordoned()
    book.observe([gpu(0, **HOT), gpu(1)], 115.0)
    assert book.cordoned()[("n1", 0)].since_s == 10.0  # same cordon, not a new one
    for t in (120.0, 140.0, 160.0, 180.0, 200.0):
        assert book.observe([gpu(0), gpu(1)], t) == []
    changes = book.observe([gpu(0), gpu(1)], 220.0)
    assert [(c.gpu, c.action, c.source) for c in changes] == [(0, "uncordon", "health")]
    assert book.cordoned() == {}
    assert book.drain_targets() == set()


def test_gap_in_samples_restarts_healthy_period() -> None:
    book = CordonBook(RULES)
    book.observe([gpu(0, **HOT)], 0.0)
    book.observe([gpu(0)], 10.0)
    # agent silent for longer than agent_silence_s: continuity is not proven
    assert book.observe([gpu(0)], 200.0) == []
    assert ("n1", 0) in book.cordoned()
    for t in (220.0, 240.0, 260.0, 280.0):
        assert book.observe([gpu(0)], t) == []
    assert book.observe([gpu(0)], 300.0)[0].action == "uncordon"


def test_keep_mode_does_not_drain() -> None:
    book = CordonBook(HealthRules(on_unhealthy="keep"))
    [change] = book.observe([gpu(0, lost=True)], 0.0)
    assert change.drain is False
    assert book.drain_targets() == set()
    assert book.cordoned()[("n1", 0)].reason == "gpu_lost"


def test_gpu_missing_from_report_is_lost() -> None:
    book = CordonBook(RULES)
    book.observe([gpu(0), gpu(1)], 0.0)
    changes = book.observe([gpu(0)], 5.0)
    assert [(c.gpu, c.reason) for c in changes] == [(1, "gpu_lost")]
    sample = book.latest_sample("n1", 1)
    assert sample is not None and sample.lost


def test_empty_report_leaves_node_unknown_not_unhealthy() -> None:
    book = CordonBook(RULES)
    book.observe_report(AgentReport("n1", 0.0, "nvml", [gpu(0)]), 0.0)
    book.observe_report(AgentReport("n1", 50.0, "nvml", [], ["nvml init failed"]), 50.0)
    assert book.cordoned() == {}
    assert book.unknown_nodes(50.0) == {"n1"}


def test_operator_cordon_is_sticky() -> None:
    book = CordonBook(RULES)
    book.cordon_manual("n1", 0, "fan noise", 0.0)
    for t in range(0, 1000, 10):
        book.observe([gpu(0)], float(t))
    entry = book.cordoned()[("n1", 0)]
    assert (entry.source, entry.reason, entry.since_s) == ("operator", "fan noise", 0.0)
    assert book.drain_targets() == set()  # cordon is not drain
    [lift] = book.uncordon_manual("n1", 0, 1000.0)
    assert (lift.action, lift.source) == ("uncordon", "operator")
    assert book.cordoned() == {}


def test_operator_cordon_survives_health_cycle_and_wins_precedence() -> None:
    book = CordonBook(RULES)
    book.cordon_manual("n1", 0, "maintenance", 0.0)
    book.observe([gpu(0, **HOT)], 1.0)
    assert book.cordoned()[("n1", 0)].source == "operator"
    assert [e["source"] for e in book.to_state()["gpus"][0]["entries"]] == ["health", "operator"]
    for t in range(10, 140, 20):
        book.observe([gpu(0)], float(t))
    assert [e["source"] for e in book.to_state()["gpus"][0]["entries"]] == ["operator"]


def test_uncordon_manual_leaves_health_cordon() -> None:
    book = CordonBook(RULES)
    book.observe([gpu(0, **HOT)], 0.0)
    assert book.uncordon_manual("n1", 0, 1.0) == []
    assert book.cordoned()[("n1", 0)].source == "health"


def test_crash_cordon_threshold_window_and_expiry() -> None:
    book = CordonBook(HealthRules(crash_threshold=3, crash_window_s=100.0, crash_cordon_s=500.0))
    assert book.record_crash("n1", 2, 0.0) == []
    assert book.record_crash("n1", 2, 10.0) == []
    assert book.record_crash("n1", 2, 150.0) == []  # the first two fell out of the window
    assert book.record_crash("n1", 2, 160.0) == []
    [c] = book.record_crash("n1", 2, 170.0)
    assert (c.action, c.source) == ("cordon", "crash")
    assert book.cordoned()[("n1", 2)].since_s == 170.0
    assert book.tick(600.0) == []
    [lift] = book.tick(670.0)
    assert (lift.action, lift.source) == ("uncordon", "crash")
    assert book.cordoned() == {}


def test_crash_cordon_lifted_by_operator_and_no_expiry_when_zero() -> None:
    book = CordonBook(HealthRules(crash_threshold=1, crash_cordon_s=0.0))
    book.record_crash("n1", 0, 0.0)
    assert book.tick(1e9) == []
    assert [c.source for c in book.uncordon_manual("n1", 0, 1e9)] == ["crash"]
    assert book.cordoned() == {}


def test_preflight_uses_that_gpu() -> None:
    book = CordonBook(RULES)
    book.observe([gpu(0, memory_used_mb=1000), gpu(2, memory_used_mb=79000)], 0.0)
    assert book.preflight_ok("n1", 0, 20000) == (True, "")
    ok, why = book.preflight_ok("n1", 2, 20000)
    assert not ok and "n1:2" in why and "1000 MiB free" in why
    assert book.preflight_ok("n1", 1, 10)[0] is False  # no sample
    assert book.preflight_ok("n2", 0, 10) == (False, "no telemetry for n2:0")


def test_preflight_cordon_lifts_when_memory_is_free() -> None:
    book = CordonBook(RULES)
    book.observe([gpu(2, memory_used_mb=79000)], 0.0)
    ok, why = book.preflight_ok("n1", 2, 20000)
    assert not ok
    c = book.record_preflight_failure("n1", 2, 20000, why, 1.0)
    assert c is not None and book.cordoned()[("n1", 2)].source == "preflight"
    book.observe([gpu(2, memory_used_mb=70000)], 5.0)
    assert ("n1", 2) in book.cordoned()
    [lift] = book.observe([gpu(2, memory_used_mb=500)], 10.0)
    assert (lift.action, lift.source) == ("uncordon", "preflight")


def test_unknown_nodes() -> None:
    book = CordonBook(RULES)
    book.observe([gpu(0, node="n1"), gpu(0, node="n2")], 0.0)
    book.observe([gpu(0, node="n2")], 40.0)
    assert book.unknown_nodes(45.0) == {"n1"}
    assert book.unknown_nodes(45.0, silence_s=100.0) == set()
    assert book.unknown_nodes(45.0, nodes=["n1", "n2", "n3"]) == {"n1", "n3"}


def test_state_round_trip_through_json() -> None:
    book = CordonBook(RULES)
    book.observe([gpu(0, **HOT), gpu(1), gpu(0, node="n2")], 0.0)
    book.observe([gpu(0), gpu(1), gpu(0, node="n2")], 10.0)  # healthy period started
    book.cordon_manual("n1", 1, "drill", 11.0)
    book.record_crash("n2", 0, 12.0)
    state = json.loads(json.dumps(book.to_state()))
    again = CordonBook.from_state(state, RULES)
    assert again.cordoned() == book.cordoned()
    assert again.to_state() == book.to_state()
    assert again.unknown_nodes(20.0) == set()
    # hysteresis continues from the persisted healthy_since_s
    for t in (30.0, 50.0, 70.0, 90.0):
        assert again.observe([gpu(0), gpu(1), gpu(0, node="n2")], t) == []
    changes = again.observe([gpu(0), gpu(1), gpu(0, node="n2")], 110.0)
    assert [(c.node, c.gpu, c.action) for c in changes] == [("n1", 0, "uncordon")]


@pytest.mark.parametrize("bad", [{}, {"version": 99}, {"version": 1, "gpus": [{"node": "n"}]}])
def test_bad_state_raises(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        CordonBook.from_state(bad)


def test_prolog_samples_are_judged_with_the_jobs_rules_and_lift_after_a_healthy_period() -> None:
    book = CordonBook(HealthRules(max_temperature_c=70.0, healthy_period_s=100.0, agent_silence_s=1000.0))
    warm = gpu(1, temperature_c=80.0)  # healthy by the default rules (87 C), not by this job's
    changes = book.record_prolog([gpu(0), warm], 0.0)
    assert [(c.gpu, c.action, c.source) for c in changes] == [(1, "cordon", "prolog")]
    entry = book.cordoned()[("n1", 1)]
    assert entry.source == "prolog" and entry.reason == "before the job: temperature_c=80>70"
    assert book.unknown_nodes(0.0, nodes=["n1"]) == {"n1"}  # only the agent counts as hearing a node
    assert book.record_prolog([warm], 5.0) == []  # read twice: one cordon
    assert CordonBook.from_state(json.loads(json.dumps(book.to_state())), book.rules).cordoned() == book.cordoned()
    book.observe([gpu(0), gpu(1)], 10.0)  # the agent finds it cool now
    assert ("n1", 1) in book.cordoned()
    changes = book.observe([gpu(0), gpu(1)], 110.0)
    assert [(c.gpu, c.action, c.source) for c in changes] == [(1, "uncordon", "prolog")]
    assert book.cordoned() == {}
