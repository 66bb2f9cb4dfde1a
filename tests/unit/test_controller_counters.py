"""The controller's own load figures: tick durations and heartbeats handled (status and /metrics)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from slurm_elastic.controller import runtime
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.metrics import metrics_registry
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.health import AgentReport, GpuSample
from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.slurm.parse import StepInfo
from slurm_elastic.status_view import worker_counts
from tests.stub_backend import ListedSteps


def make_controller(tmp: Path) -> Controller:
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0},
                           "controller": {"tick_interval_s": 0.01}})
    steps = [StepInfo(1, "3", worker_step_name("w1"), ("node1",), "0:01", "", "gres/gpu:1", 1)]
    controller = Controller(config, 1, ListedSteps(steps), tmp, gpus_by_node={"node1": (0, 1)})  # type: ignore[arg-type]
    controller.scale(1)
    controller.tick()  # se-w-w1 is listed: w1 is this controller's worker
    return controller


def test_status_summarizes_recent_tick_durations(tmp_path: Path) -> None:
    controller = make_controller(tmp_path)
    assert controller.status()["tick_duration_s"] == {"p50": 0.0, "p95": 0.0, "max": 0.0, "count": 0, "total_s": 0.0,
                                                       "total_count": 0}
    stop = threading.Event()
    loop = threading.Thread(target=controller.run_forever, args=(stop,))
    loop.start()
    try:
        while controller.status()["tick_duration_s"]["count"] < 5:
            stop.wait(0.01)
    finally:
        stop.set()
        loop.join()
    summary = controller.status()["tick_duration_s"]
    assert 0 < summary["p50"] <= summary["p95"] <= summary["max"] <= summary["total_s"]


def test_heartbeats_are_counted(tmp_path: Path) -> None:
    controller = make_controller(tmp_path)
    controller.register_worker("w1", {"node": "node1", "gpus": [0], "step_id": "3"})
    for _ in range(3):
        controller.heartbeat("w1", {"busy": True})
    assert controller.status()["heartbeats"] == 3


def test_heartbeats_alone_do_not_rewrite_the_state_file(tmp_path: Path) -> None:
    controller = make_controller(tmp_path)
    controller.register_worker("w1", {"node": "node1", "gpus": [0], "step_id": "3"})
    path = controller.state_file.path
    written = path.stat().st_ino  # every write replaces the file
    controller.heartbeat("w1", {"busy": True, "rollouts": 5})
    controller.save()
    assert path.stat().st_ino == written
    controller.scale(2)  # a durable change is written at once
    assert path.stat().st_ino != written
    assert controller.state_file.load().manual_target == 2


def test_agent_reports_alone_do_not_rewrite_the_state_file_and_a_crash_is_written_at_once(tmp_path: Path) -> None:
    """Each report moves when its node was last heard: 32 agents made a write at every tick (a 256-
    worker pool's 214 kB, twice a second)."""
    controller = make_controller(tmp_path)
    path = controller.state_file.path
    controller.save()
    written = path.stat().st_ino
    for now_s in (1.0, 2.0):
        controller.report_gpu_health(AgentReport("node1", now_s, "inject", [
            GpuSample("node1", gpu, temperature_c=40.0, memory_used_mb=0, memory_total_mb=80000) for gpu in (0, 1)]))
        controller.save()
    assert path.stat().st_ino == written
    controller.state.cordons.record_crash("node1", 1, 3.0)
    controller.save()
    assert path.stat().st_ino != written
    saved = controller.state_file.load().cordons
    assert [(g["gpu"], g["crashes_s"]) for g in saved["gpus"]] == [(1, [3.0])] and list(saved["heard_s"]) == ["node1"]


def test_live_fields_are_written_after_the_refresh_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    controller = make_controller(tmp_path)
    controller.register_worker("w1", {"node": "node1", "gpus": [0], "step_id": "3"})
    controller.heartbeat("w1", {"rollouts": 7})
    monkeypatch.setattr(controller, "_saved_at_s", controller._saved_at_s - runtime.STATE_REFRESH_S)
    controller.save()
    assert controller.state_file.load().workers["w1"].rollouts == 7



def test_a_placeholder_is_counted_apart_from_the_workers(tmp_path: Path) -> None:
    controller = make_controller(tmp_path)
    controller.cordon("node1", 0, "test")
    assert controller.register_worker("w1", {"node": "node1", "gpus": [0], "step_id": "3"})["action"] == "hold"
    status = controller.status()
    assert (status["workers_by_state"]["ACTIVE"], status["placeholders"]) == (0, 1)
    assert worker_counts(status) == "placeholders 1"
    queue = RolloutQueue(RolloutStore(tmp_path / "q.sqlite", fsync="off"), QueueConfig())
    text = generate_latest(metrics_registry(controller, queue)).decode()
    assert 'slurm_elastic_workers{state="ACTIVE"} 0.0' in text and "slurm_elastic_placeholders 1.0" in text
    queue.store.close()


def test_counts_that_only_grow_are_counters_and_levels_are_gauges(tmp_path: Path) -> None:
    """Prometheus' naming rule: a ``_total`` series is a counter's, a gauge has none (what
    ``promtool check metrics`` and ``rate()`` expect)."""
    from prometheus_client.parser import text_string_to_metric_families

    from slurm_elastic.controller.connections import ConnectionBook

    controller = make_controller(tmp_path)
    controller.heartbeat("w1", {"rollouts": 1})
    queue = RolloutQueue(RolloutStore(tmp_path / "q.sqlite", fsync="off"), QueueConfig())
    text = generate_latest(metrics_registry(controller, queue, ConnectionBook(max_connections=4, head_timeout_s=1.0))).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for family in families.values():
        for sample in family.samples:
            assert sample.name.endswith("_total") == (family.type == "counter"), (family.type, sample.name)
            assert ("quantile" in sample.labels) <= (family.type == "summary"), sample  # a quantile is a summary's
    tick = families["slurm_elastic_tick_duration_seconds"]
    assert tick.type == "summary" and {s.name for s in tick.samples} == {
        "slurm_elastic_tick_duration_seconds", "slurm_elastic_tick_duration_seconds_sum",
        "slurm_elastic_tick_duration_seconds_count"}
    controller.tick_durations_s.extend([0.01] * 60)  # the window is full; 100 ticks ran in all
    controller.tick_total_s, controller.tick_total_count = 1.5, 100
    text = generate_latest(metrics_registry(controller, queue)).decode()
    tick = {f.name: f for f in text_string_to_metric_families(text)}["slurm_elastic_tick_duration_seconds"]
    assert {s.name: s.value for s in tick.samples if not s.labels} == {
        "slurm_elastic_tick_duration_seconds_sum": 1.5, "slurm_elastic_tick_duration_seconds_count": 100}
    started = families["slurm_elastic_controller_start_time_seconds"].samples[0].value
    assert abs(started - (time.time() - controller.status()["uptime_s"])) < 5
    counters = {name for name, f in families.items() if f.type == "counter"}
    assert {"slurm_elastic_delivered_sequences", "slurm_elastic_heartbeats", "slurm_elastic_ticks",
            "slurm_elastic_api_connections_closed", "slurm_elastic_burst_gpu_seconds_held"} <= counters
    assert "slurm_elastic_heartbeats_total 1.0" in text
    assert families["slurm_elastic_queued_sequences"].type == "gauge"
    queue.store.close()
