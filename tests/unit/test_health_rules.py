"""Health rules: each cordon reason, each do-not-cordon reason, the ``[health]`` table and the agent report's wire form."""

from __future__ import annotations

import pytest

from slurm_elastic.client.wire import AgentReportBody, GpuSampleBody, report_json, sample_json
from slurm_elastic.controller.config import parse_config
from slurm_elastic.core.health import (
    CLOCK_EVENT_FLAGS,
    AgentReport,
    GpuSample,
    HealthRules,
    evaluate,
    parse_gpu_ref,
)
from slurm_elastic.errors import ConfigError


def healthy(**kw: object) -> GpuSample:
    base: dict[str, object] = dict(
        node="n1",
        index=0,
        uuid="GPU-0",
        temperature_c=50.0,
        clock_event_reasons=frozenset(),
        memory_used_mb=1000,
        memory_total_mb=80000,
        utilization_pct=90.0,
        power_w=300.0,
        ecc_uncorrectable_volatile=0,
        retired_pages_pending=False,
        remapped_rows_pending=False,
        remapped_rows_failure=False,
    )
    base.update(kw)
    return GpuSample(**base)  # type: ignore[arg-type]


RULES = HealthRules()


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"clock_event_reasons": frozenset({"hw_slowdown"})}, ["hw_slowdown"]),
        ({"clock_event_reasons": frozenset({"hw_thermal_slowdown"})}, ["hw_thermal_slowdown"]),
        ({"clock_event_reasons": frozenset({"sw_thermal_slowdown"})}, ["sw_thermal_slowdown"]),
        ({"clock_event_reasons": frozenset({"hw_power_brake"})}, ["hw_power_brake"]),
        ({"clock_event_reasons": frozenset({"reliability"})}, ["reliability"]),
        ({"temperature_c": 95.0}, ["temperature_c=95>87"]),
        ({"ecc_uncorrectable_volatile": 2}, ["ecc_uncorrectable_volatile=2"]),
        ({"retired_pages_pending": True}, ["retired_pages_pending"]),
        ({"remapped_rows_pending": True}, ["remapped_rows_pending"]),
        ({"remapped_rows_failure": True}, ["remapped_rows_failure"]),
        ({"lost": True}, ["gpu_lost"]),
        (
            {"temperature_c": None, "clock_event_reasons": None, "memory_total_mb": None},
            ["unreadable"],
        ),
        (
            {"clock_event_reasons": frozenset({"hw_slowdown", "hw_thermal_slowdown", "idle"})},
            ["hw_slowdown", "hw_thermal_slowdown"],
        ),
    ],
)
def test_cordon_reasons(changes: dict[str, object], expected: list[str]) -> None:
    assert evaluate(healthy(**changes), RULES) == expected


@pytest.mark.parametrize(
    "flag",
    ["idle", "applications_clocks", "sw_power_cap", "sync_boost", "display_clock", "board_limit"],
)
def test_normal_clock_events_do_not_cordon(flag: str) -> None:
    assert evaluate(healthy(clock_event_reasons=frozenset({flag})), RULES) == []


def test_sw_power_cap_under_load_is_healthy() -> None:
    s = healthy(
        clock_event_reasons=frozenset({"sw_power_cap"}), utilization_pct=100.0, power_w=700.0
    )
    assert evaluate(s, RULES) == []


def test_unknown_bits_and_unread_fields_do_not_cordon() -> None:
    s = healthy(
        clock_event_reasons=frozenset({"unknown_0x800"}),
        ecc_uncorrectable_volatile=None,
        retired_pages_pending=None,
        errors=["ecc_uncorrectable_volatile: Not Supported"],
    )
    assert evaluate(s, RULES) == []


def test_temperature_at_threshold_is_healthy() -> None:
    assert evaluate(healthy(temperature_c=87.0), RULES) == []


def rules_of(table: dict[str, object]) -> HealthRules:
    return parse_config({"health": table}).health.rules()


def test_rules_from_the_health_table_and_defaults() -> None:
    r = rules_of(
        {
            "max_temperature_c": 80,
            "healthy_period_s": 60,
            "on_unhealthy": "keep",
            "crash_threshold": 5,
            "crash_window_s": 120.5,
            "cordon_clock_events": ["hw_slowdown", "sw_power_cap"],
            "cordon_on_unreadable": False,
        }
    )
    assert r.max_temperature_c == 80.0 and r.healthy_period_s == 60.0
    assert r.on_unhealthy == "keep" and r.crash_threshold == 5
    assert r.cordon_clock_events == frozenset({"hw_slowdown", "sw_power_cap"})
    assert evaluate(healthy(clock_event_reasons=frozenset({"sw_power_cap"})), r) == ["sw_power_cap"]
    assert rules_of({}) == HealthRules()
    assert set(HealthRules().cordon_clock_events) <= set(CLOCK_EVENT_FLAGS)


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"max_temp": 80}, "health.max_temp"),
        ({"on_unhealthy": "kill"}, "health.on_unhealthy"),
        ({"healthy_period_s": -1}, "health.healthy_period_s"),
        ({"healthy_period_s": "5m"}, "health.healthy_period_s"),
        ({"crash_threshold": 0}, "health.crash_threshold"),
        ({"crash_threshold": 2.5}, "health.crash_threshold"),
        ({"cordon_clock_events": ["hw_slowdwn"]}, "health.cordon_clock_events"),
        ({"cordon_clock_events": "hw_slowdown"}, "health.cordon_clock_events"),
        ({"cordon_on_unreadable": "yes"}, "health.cordon_on_unreadable"),
        ({"max_temperature_c": True}, "health.max_temperature_c"),
    ],
)
def test_the_health_table_names_a_bad_key(table: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        rules_of(table)


def test_sample_and_report_round_trip() -> None:
    s = healthy(clock_event_reasons=frozenset({"idle", "sw_power_cap"}), errors=["power_w: x"])
    assert GpuSampleBody.model_validate(sample_json(s)).to_core() == s
    rep = AgentReport("n1", 12.5, "nvml", [s], ["note"])
    assert AgentReportBody.model_validate(report_json(rep)).to_core() == rep


@pytest.mark.parametrize(
    "bad",
    [
        {"node": "n1", "sampled_at_s": 1, "gpus": [{"node": "n2", "index": 0}]},
        {"node": "n1", "sampled_at_s": "x", "gpus": []},
        {"node": "", "sampled_at_s": 1, "gpus": []},
        {"node": "n1", "sampled_at_s": 1, "gpus": [{"node": "n1", "index": -1}]},
        {"node": "n1", "sampled_at_s": 1, "gpus": [{"node": "n1", "index": 0, "bogus": 1}]},
        {"node": "n1", "sampled_at_s": 1, "gpus": [{"node": "n1", "index": 0, "lost": "no"}]},
    ],
)
def test_bad_reports_raise_value_error(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        AgentReportBody.model_validate(bad)


def test_parse_gpu_ref() -> None:
    assert parse_gpu_ref("node1:2") == ("node1", 2)
    assert parse_gpu_ref("a:b:3") == ("a:b", 3)
    for bad in ("node1", ":2", "node1:x", "node1:", "node1:\u0663", "node1:\uff13"):  # other scripts' digits too
        with pytest.raises(ValueError):
            parse_gpu_ref(bad)
