"""The autoscaler's memory across a controller restart, through the real state file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_elastic.controller.state_model import AutoscalerMemory, StallMemoryState, WorkerRecord
from slurm_elastic.core.autoscaler_config import AutoscalerConfig
from slurm_elastic.core.lifecycle import Worker
from slurm_elastic.core.scaling import Autoscaler
from slurm_elastic.core.speedup import UsualCount
from slurm_elastic.core.stalls import StallMemory
from slurm_elastic.core.swings import SwingMemory
from tests.unit.test_busy_time import Clock, controller_with_two_workers


def test_the_autoscalers_memory_survives_a_restart_through_the_state_file(tmp_path: Path) -> None:
    """The window's entries carry the trainer's demand then, and the start-up's progress, the
    usual count, the trainer's recurring stalls, the load's swings and a new worker's lead time are kept: a restarted
    controller takes them back from state.json, with no note of a bad file."""
    clock = Clock()
    first = controller_with_two_workers(tmp_path, clock)
    scaler = first.state.autoscaler
    scaler.window = [(990.0, 6.0, 3.2), (995.0, 5.5, None)]
    scaler.ramped, scaler.starting = False, True
    scaler.usual = UsualCount(11.5, 12.0, 990.0)
    scaler.stalls = StallMemory([138.0, 150.0], since_s=980.0, restored=True)  # a recurring stall, in progress
    scaler.swings = SwingMemory([700.0, 960.0])  # two scale-downs a starving trainer undid
    scaler.lead_s, scaler.first_seen_s = 54.0, 940.0
    first.save()
    again = controller_with_two_workers(tmp_path, clock)
    assert again.state_notes == []
    assert again.state.autoscaler.window == scaler.window
    assert (again.state.autoscaler.ramped, again.state.autoscaler.starting) == (False, True)
    assert again.state.autoscaler.usual == UsualCount(11.5, 12.0, 990.0)
    assert again.state.autoscaler.stalls == StallMemory([138.0, 150.0], since_s=980.0, restored=True)
    assert again.state.autoscaler.swings == SwingMemory([700.0, 960.0])
    assert (again.state.autoscaler.lead_s, again.state.autoscaler.first_seen_s) == (54.0, 940.0)


@pytest.mark.parametrize("usual", [[11.5, 0.0, 990.0], [11.5, "fast", 990.0], [-1.0, 12.0, 990.0], [11.5, 12.0]])
def test_a_damaged_usual_count_is_dropped_with_a_note(tmp_path: Path, usual: list[object]) -> None:
    clock = Clock()
    first = controller_with_two_workers(tmp_path, clock)
    first.state.autoscaler.usual = UsualCount(11.5, 12.0, 990.0)
    first.save()
    state_json = next(tmp_path.rglob("state.json"))
    body = json.loads(state_json.read_text())
    body["state"]["autoscaler"]["usual"] = usual  # a zero demand would divide by zero at the next speed-up
    state_json.write_text(json.dumps(body))
    again = controller_with_two_workers(tmp_path, clock)
    assert any("autoscaler memory is not valid" in note for note in again.state_notes)
    assert again.state.autoscaler.usual is None


@pytest.mark.parametrize("key, value", [("stalls", {"durations_s": [138.0, -5.0]}), ("stalls", {"since_s": "now"}),
                                        ("stalls", [138.0]), ("lead_s", 0.0), ("lead_s", "54 s"),
                                        ("first_seen_s", "then"), ("swings", ["then"]), ("swings", 960.0)])
def test_a_damaged_stall_memory_or_lead_time_is_dropped_with_a_note(tmp_path: Path, key: str, value: object) -> None:
    clock = Clock()
    first = controller_with_two_workers(tmp_path, clock)
    first.state.autoscaler.stalls = StallMemory([138.0])
    first.state.autoscaler.lead_s = 54.0
    first.state.autoscaler.swings = SwingMemory([700.0, 960.0])
    first.save()
    state_json = next(tmp_path.rglob("state.json"))
    body = json.loads(state_json.read_text())
    body["state"]["autoscaler"][key] = value
    state_json.write_text(json.dumps(body))
    again = controller_with_two_workers(tmp_path, clock)
    assert any("autoscaler memory is not valid" in note for note in again.state_notes)
    assert again.state.autoscaler.stalls == StallMemory() and again.state.autoscaler.lead_s is None
    assert again.state.autoscaler.swings == SwingMemory()


def test_a_lost_autoscaler_memory_does_not_start_the_job_up_again(tmp_path: Path) -> None:
    clock = Clock()
    first = controller_with_two_workers(tmp_path, clock)
    first.state.autoscaler.ramped = False
    first.save()
    state_json = next(tmp_path.rglob("state.json"))
    body = json.loads(state_json.read_text())
    body["state"]["autoscaler"]["votes"] = "many"  # damaged: the memory is dropped with a note
    state_json.write_text(json.dumps(body))
    again = controller_with_two_workers(tmp_path, clock)
    assert any("autoscaler memory is not valid" in note for note in again.state_notes)
    assert again.state.autoscaler.ramped  # a running job: no start-up filling every GPU again


def test_every_key_the_autoscaler_and_a_worker_save_is_one_the_state_file_reads() -> None:
    """The state model ignores keys it does not name: a key added to ``to_state`` (or a field to
    ``Worker``) and not to the model would be written and silently dropped at every restart (as
    the stall memory once was)."""
    saved = Autoscaler(AutoscalerConfig()).to_state()
    assert set(saved) == set(AutoscalerMemory.model_fields)
    assert set(saved["stalls"]) == set(StallMemoryState.model_fields)
    assert set(Worker.__dataclass_fields__) == set(WorkerRecord.model_fields)
