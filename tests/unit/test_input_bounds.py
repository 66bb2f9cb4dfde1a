"""Every number a config file or a trace gives is bounded: NaN, infinities, 1e300, 10^30, a boolean,
a string or an empty string is refused naming the key, and so are values past each key's largest
(core/limits.py says why each is the largest). Before, 1e300 loaded as a gain, a timeout or a
sample spread: kp = 1e300 recommended 9.9e158 workers (the simulator's steady trace), a trace's
``rollout.sigma = 800`` ended the simulation in a traceback, and 10^30 reached Slurm and SQLite."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from slurm_elastic.controller.burst_config import BurstSection
from slurm_elastic.controller.config import ElasticConfig, parse_config
from slurm_elastic.core.autoscaler_config import AutoscalerConfig
from slurm_elastic.errors import ConfigError
from slurm_elastic.rollouts.config import QueueConfig
from slurm_elastic.sim import trace as trace_module
from slurm_elastic.sim.trace import parse_trace

BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "1e300": 1e300, "10^30": 10**30,
       "2^63": 2**63, "true": True, "string": "3", "empty": ""}


def _numeric_keys() -> list[tuple[str, str]]:
    keys = []
    for section, field in ElasticConfig.model_fields.items():
        model = field.annotation
        for name, inner in getattr(model, "model_fields", {}).items():
            if inner.annotation in (int, float):
                keys.append((section, name))
    for section, cls in (("autoscaler", AutoscalerConfig), ("queue", QueueConfig)):
        keys += [(section, f.name) for f in dataclasses.fields(cls) if type(f.default) in (int, float)]
    return keys


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize(("section", "key"), _numeric_keys(), ids=[".".join(k) for k in _numeric_keys()])
def test_every_numeric_config_key_refuses_nonsense_naming_the_key(section: str, key: str, bad: str) -> None:
    with pytest.raises(ConfigError, match=rf"{section}\.{key}\b"):
        parse_config({section: {key: BAD[bad]}})


def _trace_keys() -> list[tuple[str, str]]:
    tables = {"cluster": trace_module.ClusterSpec, "queue": trace_module.QueueSpec, "trainer": trace_module.TrainerSpec,
              "rollout": trace_module.RolloutSpec, "baselines": trace_module.Baselines,
              "phases": trace_module.Phase, "failures": trace_module.Failure, "throttles": trace_module.Throttle}
    return [(table, f.name) for table, cls in tables.items() for f in dataclasses.fields(cls)
            if type(f.default) in (int, float)] + [("", "duration_s"), ("", "seed")]


@pytest.mark.parametrize("bad", ["nan", "inf", "1e300", "10^30", "true", "string"])
@pytest.mark.parametrize(("table", "key"), _trace_keys(), ids=[".".join(k) for k in _trace_keys()])
def test_every_numeric_trace_field_refuses_nonsense_naming_the_field(table: str, key: str, bad: str) -> None:
    value = BAD[bad]
    if key == "seed" and bad == "10^30":  # any whole seed >= 0 seeds the RNG: taken as it is
        assert parse_trace({key: value}).seed == value
        return
    if not table:
        doc: dict[str, Any] = {key: value}
        named = key
    elif table in ("phases", "failures", "throttles"):
        doc, named = {table: [{key: value}]}, rf"{table}\[0\]\.{key}"
    else:
        doc, named = {table: {key: value}}, rf"{table}\.{key}"
    with pytest.raises(ConfigError, match=rf"^{named}\b"):
        parse_trace(doc)


@pytest.mark.parametrize(("doc", "says"), [
    # the control law's gains: finite, >= 0, and at most 10, 1/s and 60 s
    ({"autoscaler": {"kp": 1e300}}, "autoscaler.kp: 1e+300 is above its largest, 10 (kp = 1 closes"),
    ({"autoscaler": {"kp": 10.5}}, "autoscaler.kp: 10.5 is above its largest, 10"),
    ({"autoscaler": {"ki": 2}}, "autoscaler.ki: 2 is above its largest, 1 (the integral's time constant"),
    ({"autoscaler": {"kd": 3600}}, "autoscaler.kd: 3600 is above its largest, 60"),
    ({"autoscaler": {"kp": float("nan")}}, "autoscaler.kp: must be a finite number, not nan"),
    ({"autoscaler": {"ki": -0.1}}, "autoscaler.ki: must be >= 0"),
    ({"autoscaler": {"horizon_s": 7200}}, "autoscaler.horizon_s: 7200 is above its largest, 3600"),
    ({"autoscaler": {"max_workers": 10**30}}, "autoscaler.max_workers: 1000000000000000000000000000000 is above its "
                                              "largest, 40000 (Slurm's MaxStepCount"),
    ({"autoscaler": {"confirmations": 0}}, "autoscaler.confirmations: must be >= 1"),
    ({"autoscaler": {"max_step_down": 0}}, "autoscaler.max_step_down: must be >= 1"),
    ({"autoscaler": {"deadband_workers": 64}}, "autoscaler.deadband_workers (64) must be below max_workers - min_workers (63)"),
    ({"autoscaler": {"min_workers": 2, "max_workers": 4, "deadband_workers": 2.5}},
     "autoscaler.deadband_workers (2.5) must be below max_workers - min_workers (2)"),
    ({"queue": {"max_staleness": 10**30}}, "queue.max_staleness: 1000000000000000000000000000000 is above its "
                                           "largest, 1000"),
    ({"queue": {"admission_ttl_s": 10**12}}, "queue.admission_ttl_s: 1000000000000 is above its largest, 31622400"),
    ({"controller": {"slurm_timeout_s": 1e300}}, "controller.slurm_timeout_s: Input should be less than or equal to 3600"),
    ({"workers": {"heartbeat_grace_s": 1e300}}, "workers.heartbeat_grace_s: Input should be less than or equal to 31622400"),
    ({"job": {"nodes": 10**30}}, "job.nodes: Input should be less than or equal to 65536"),
    ({"health": {"max_temperature_c": 1e300}}, "health.max_temperature_c: Input should be less than or equal to 200"),
    # across keys: timers as long as the job
    ({"autoscaler": {"scale_down_cooldown_s": 7200}, "job": {"time_limit": "01:00:00"}},
     "autoscaler.scale_down_cooldown_s (7200) is not shorter than job.time_limit (01:00:00 = 3600 s)"),
    ({"autoscaler": {"min_stable_period_s": 600}, "job": {"time_limit": "10"}},
     "autoscaler.min_stable_period_s (600) is not shorter than job.time_limit (10 = 600 s): the autoscaler would never act"),
    ({"workers": {"heartbeat_grace_s": 3600}, "job": {"time_limit": "1:00:00"}}, "workers.heartbeat_grace_s (3600)"),
    ({"burst": {"max_jobs": 1, "time_limit": "00:05:00", "controller_unreachable_grace_s": 600}},
     "burst.controller_unreachable_grace_s (600) is not shorter than burst.time_limit (00:05:00 = 300 s)"),
    # Slurm's time limit: sbatch takes any number of minutes and Slurm wraps those past 35791393
    ({"job": {"time_limit": "4294967297"}}, "job.time_limit: '4294967297' is 4294967297 minutes, above the largest "
                                            "time limit Slurm keeps, 35791393 minutes (24855-03:13:00, 68 years)"),
    ({"job": {"time_limit": "35791394"}}, "job.time_limit: '35791394' is 35791394 minutes, above the largest"),
    ({"job": {"time_limit": "24855-03:13:01"}}, "'24855-03:13:01' is 35791394 minutes"),  # seconds round up
    ({"job": {"time_limit": "9" * 5000}}, "is more than 10^15 minutes, above the largest"),
    ({"burst": {"time_limit": "99999999999"}}, "burst.time_limit: '99999999999' is 99999999999 minutes"),
    # a crash window under 1 s holds no two crashes: the crash guard would be off without a word
    ({"health": {"crash_window_s": 0}}, "health.crash_window_s: must be at least 1 s: a window of 0 s holds no two "
                                        "crashes (they are counted at the controller's ticks), so the "
                                        "crash_threshold (3) crashes that cordon a GPU never come"),
    ({"health": {"crash_window_s": 1e-9, "crash_threshold": 2}}, "must be at least 1 s: a window of 1e-09 s"),
    ({"health": {"crash_window_s": 0.5}}, "must be at least 1 s: a window of 0.5 s holds no two crashes"),
])
def test_a_value_past_its_bound_or_its_neighbours_is_refused_with_why(doc: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(doc)
    assert says in str(refused.value), str(refused.value)


@pytest.mark.parametrize("doc", [
    {"queue": {"batch_size": 4096}},  # 512 prompts x 8 samples, the default capacity: a full buffer scales down
    {"queue": {"batch_size": 64, "capacity_seqs": 80, "max_staleness": 2}},
    {"autoscaler": {"enabled": False, "min_workers": 0, "max_workers": 0}},  # a fixed pool: no deadband to leave
    {"autoscaler": {"min_workers": 3, "max_workers": 3, "deadband_workers": 3}},
    {"weights": {"update": "none"}, "workers": {"liveness_failure_threshold": 3}},  # defaults written out
])
def test_combinations_that_work_still_load(doc: dict[str, Any]) -> None:
    parse_config(doc)


def test_a_short_job_is_not_refused_for_the_defaults_it_did_not_set() -> None:
    """Only timers the file sets are held against job.time_limit: a 2-minute job with every default
    (start_timeout_s 120, a burst job's grace 300) loads."""
    parse_config({"job": {"time_limit": "2"}, "burst": {"max_jobs": 1, "time_limit": "00:05:00"}})


def test_the_largest_values_and_the_defaults_still_load() -> None:
    parse_config({})
    parse_config({"autoscaler": {"kp": 10, "ki": 1, "kd": 60, "horizon_s": 3600, "max_workers": 40000},
                  "queue": {"max_staleness": 1000, "capacity_seqs": 2**31},
                  "job": {"time_limit": "UNLIMITED"}, "workers": {"heartbeat_grace_s": 31622400}})
    for longest in ("35791393", "24855-03:13:00", "24855-3:13", "35791393:00", "596523:13:00", "infinite"):
        parse_config({"job": {"time_limit": longest}, "burst": {"time_limit": longest}})
    parse_config({"health": {"crash_window_s": 1}})
    parse_config({"health": {"crash_window_s": 0, "crash_threshold": 1}})  # cordons at the first crash: no window


@pytest.mark.parametrize(("doc", "says"), [
    ({"trainer": {"step_jitter": 3}}, "trainer.step_jitter: 3 is above its largest, 1"),
    ({"rollout": {"sigma": 800}}, "rollout.sigma: 800 is above its largest, 10"),
    ({"rollout": {"distribution": "pareto", "alpha": 0.01}}, "rollout.alpha: 0.01 is below its least, 0.1"),
    ({"rollout": {"max_s": 1, "median_s": 100}}, "rollout.max_s (1) is below rollout.median_s (100)"),
    ({"cluster": {"tick_interval_s": 1e-6}}, "cluster.tick_interval_s (1e-06) makes 1.8e+09 ticks"),
    ({"cluster": {"backoff_base_s": 100, "backoff_max_s": 1}}, "cluster.backoff_base_s (100) > cluster.backoff_max_s (1)"),
    ({"queue": {"admission_ttl_s": 0}}, "queue.admission_ttl_s: must be > 0"),
    ({"failures": [{"at_s": 5000}]}, "failures[0].at_s (5000) is not before duration_s (1800): it would never happen"),
    ({"phases": [{"start_s": 1800}]}, "phases[0].start_s (1800) is not before duration_s (1800)"),
    ({"throttles": [{"start_s": 10, "gpus": []}]}, "throttles[0].gpus: names no GPU slot"),
    ({"failures": [{"at_s": 10, "workers": 9}]}, "failures[0].workers (9) > cluster.gpu_slots (8)"),
    ({"duration_s": 1e300}, "duration_s: 1e+300 is above its largest, 31622400 (a year)"),
])
def test_a_trace_that_would_break_or_mislead_the_simulation_is_refused(doc: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_trace(doc)
    assert says in str(refused.value), str(refused.value)


def test_burst_durations_are_bounded_too() -> None:
    assert BurstSection.model_fields["submit_cooldown_s"].metadata  # ge and le
    with pytest.raises(ConfigError, match=r"burst\.submit_cooldown_s: Input should be less than or equal to 31622400"):
        parse_config({"burst": {"submit_cooldown_s": 1e300}})


@pytest.mark.parametrize("option", ["--constraint=a\x00b", "--constraint=a\x01b", "--comment=a\x7f"])
def test_a_burst_sbatch_option_with_a_control_character_is_refused(option: str) -> None:
    """Written into the burst script at every submission: refused at load, naming the key."""
    with pytest.raises(ConfigError) as refused:
        parse_config({"burst": {"max_jobs": 1, "extra_sbatch_options": [option]}})
    assert "burst.extra_sbatch_options" in str(refused.value), str(refused.value)


@pytest.mark.parametrize(("autoscaler", "workers", "said"), [
    ({"min_workers": 0, "max_workers": 0}, {}, "autoscaler.max_workers = 0"),
    ({"enabled": False}, {"initial_workers": 0}, "the autoscaler is off and workers.initial_workers is 0"),
])
def test_a_job_where_no_worker_ever_starts_on_its_own_is_said(
        caplog: pytest.LogCaptureFixture, autoscaler: dict[str, Any], workers: dict[str, Any], said: str) -> None:
    with caplog.at_level("WARNING"):
        parse_config({"autoscaler": autoscaler, "workers": workers})
    assert said in caplog.text and "slurm-elastic scale" in caplog.text


def test_a_job_whose_workers_start_says_nothing_of_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        parse_config({"autoscaler": {"min_workers": 0}})
    assert "no worker ever starts" not in caplog.text
