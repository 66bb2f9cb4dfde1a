"""The fault-injection source: baseline, faults with from/until, re-read, bad files."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from slurm_elastic.core.health import HealthRules, evaluate
from slurm_elastic.errors import TelemetryError
from slurm_elastic.gpu.injection import InjectionSource, default_gpu_count, fake_uuid


def test_missing_file_gives_healthy_fake_gpus(tmp_path: Path) -> None:
    src = InjectionSource("node1", tmp_path / "absent.toml", env={"SLURM_GPUS_ON_NODE": "3"})
    reading = src.sample(100.0)
    assert [g.index for g in reading.gpus] == [0, 1, 2] and reading.errors == []
    assert all(evaluate(g, HealthRules()) == [] for g in reading.gpus)
    assert reading.gpus[1].uuid == fake_uuid("node1", 1) != fake_uuid("node2", 1)
    assert InjectionSource("node1", None, gpus=2, env={}).sample(0.0).gpus[1].index == 1


@pytest.mark.parametrize(
    ("env", "n"),
    [
        ({}, 1),
        ({"SLURM_GPUS_ON_NODE": "4"}, 4),
        ({"SLURM_JOB_GPUS": "0,1"}, 2),
        ({"GPU_DEVICE_ORDINAL": "0,1,2"}, 3),
    ],
)
def test_default_gpu_count(env: dict[str, str], n: int) -> None:
    assert default_gpu_count(env) == n


def test_fault_from_now_with_duration(tmp_path: Path) -> None:
    f = tmp_path / "inject.toml"
    f.write_text(
        """
[baseline]
gpus = 4
memory_total_mb = 40000

[[fault]]
node = "node1"
gpu = 2
reasons = ["hw_thermal_slowdown"]
from = "now"
duration_s = 60
temperature_c = 96
"""
    )
    src = InjectionSource("node1", f, env={})
    gpus = src.sample(1000.0).gpus
    assert len(gpus) == 4 and gpus[0].memory_total_mb == 40000
    assert gpus[2].clock_event_reasons == {"hw_thermal_slowdown"}
    assert gpus[2].temperature_c == 96.0
    assert evaluate(gpus[2], HealthRules()) == ["hw_thermal_slowdown", "temperature_c=96>87"]
    assert gpus[1].clock_event_reasons == frozenset()
    # "now" stays pinned to the first read; the fault ends 60 s later
    assert src.sample(1059.0).gpus[2].clock_event_reasons == {"hw_thermal_slowdown"}
    assert src.sample(1060.0).gpus[2].clock_event_reasons == frozenset()
    # the other node is not affected
    assert (
        InjectionSource("node2", f, env={}).sample(1000.0).gpus[2].clock_event_reasons
        == frozenset()
    )


def test_fault_absolute_from_until_and_wildcards(tmp_path: Path) -> None:
    start = datetime(2030, 1, 1, 12, 0, tzinfo=timezone.utc).timestamp()
    f = tmp_path / "inject.toml"
    f.write_text(
        f"""
[baseline]
gpus = 2
[baseline.gpus_per_node]
node3 = 1

[[fault]]
node = "*"
from = "2030-01-01T12:00:00Z"
until = {start + 10}
lost = true

[[fault]]
node = "node1"
gpu = 1
from = {start}
ecc_uncorrectable_volatile = 3
retired_pages_pending = true
memory_used_mb = 81000
"""
    )
    src = InjectionSource("node1", f, env={})
    before = src.sample(start - 1).gpus
    assert not before[0].lost and before[1].ecc_uncorrectable_volatile == 0
    during = src.sample(start + 5).gpus
    assert during[0].lost and during[1].lost and during[1].ecc_uncorrectable_volatile == 3
    after = src.sample(start + 10).gpus
    assert not after[0].lost and after[1].retired_pages_pending and after[1].memory_used_mb == 81000
    assert len(InjectionSource("node3", f, env={}).sample(start).gpus) == 1


def test_file_is_reread_and_editing_ends_a_drill(tmp_path: Path) -> None:
    f = tmp_path / "inject.json"
    f.write_text('{"fault": [{"node": "n1", "gpu": 0, "reasons": ["hw_slowdown"]}]}')
    src = InjectionSource("n1", f, gpus=1, env={})
    assert src.sample(0.0).gpus[0].clock_event_reasons == {"hw_slowdown"}
    f.write_text("{}")
    assert src.sample(1.0).gpus[0].clock_event_reasons == frozenset()
    f.unlink()
    assert src.sample(2.0).gpus[0].clock_event_reasons == frozenset()


def test_bad_file_keeps_last_good_and_reports(tmp_path: Path) -> None:
    f = tmp_path / "inject.toml"
    f.write_text('[[fault]]\nnode = "n1"\nreasons = ["hw_slowdown"]\n')
    src = InjectionSource("n1", f, gpus=1, env={})
    assert src.sample(0.0).gpus[0].clock_event_reasons == {"hw_slowdown"}
    f.write_text("[[fault]\nnode = ")
    reading = src.sample(1.0)
    assert reading.gpus[0].clock_event_reasons == {"hw_slowdown"}
    assert "last good" in reading.errors[0]
    fresh = InjectionSource("n1", f, gpus=1, env={})  # an agent relaunched on the broken file: no good version
    reading = fresh.sample(2.0)
    assert reading.gpus == [] and "no good version read yet" in reading.errors[0]


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[[fault]]\nnode = "n1"\ntemprature_c = 90\n', "fault[0].temprature_c"),
        ('[[fault]]\nnode = "n1"\nreasons = ["thermal"]\n', "fault[0].reasons"),
        ('[[fault]]\nnode = "n1"\nfrom = "soon"\n', "fault[0].from"),
        ('[[fault]]\nnode = "n1"\nlost = "yes"\n', "fault[0].lost"),
        ("[[fault]]\ngpu = 1\n", "fault[0].node"),
        ("[baseline]\ngpu = 2\n", "baseline.gpu"),
        ("[faults]\n", "'faults'"),
    ],
)
def test_bad_entries_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    f = tmp_path / "inject.toml"
    f.write_text(text)
    with pytest.raises(TelemetryError, match=key.replace("[", r"\[").replace("]", r"\]")):
        InjectionSource("n1", f, env={}).load(0.0)
