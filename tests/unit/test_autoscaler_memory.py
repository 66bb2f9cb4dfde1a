"""The autoscaler's memory across a controller restart, through the real state file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_elastic.core.speedup import UsualCount
from tests.unit.test_busy_time import Clock, controller_with_two_workers


def test_the_autoscalers_memory_survives_a_restart_through_the_state_file(tmp_path: Path) -> None:
    """The window's entries carry the trainer's demand then, and the start-up's progress and the
    usual count are kept: a restarted controller takes them back from state.json, with no note of
    a bad file."""
    clock = Clock()
    first = controller_with_two_workers(tmp_path, clock)
    scaler = first.state.autoscaler
    scaler.window = [(990.0, 6.0, 3.2), (995.0, 5.5, None)]
    scaler.ramped, scaler.starting = False, True
    scaler.usual = UsualCount(11.5, 12.0, 990.0)
    first.save()
    again = controller_with_two_workers(tmp_path, clock)
    assert again.state_notes == []
    assert again.state.autoscaler.window == scaler.window
    assert (again.state.autoscaler.ramped, again.state.autoscaler.starting) == (False, True)
    assert again.state.autoscaler.usual == UsualCount(11.5, 12.0, 990.0)


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
