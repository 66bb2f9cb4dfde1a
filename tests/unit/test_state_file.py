"""The state file is validated like any input: what validates is kept, the rest is dropped and
said (log, ``status``), and the controller starts and ticks whatever the file holds. On the real
file on disk, with the real controller in process (Slurm is a listed-steps stub)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.state import STATE_FORMAT
from slurm_elastic.controller.state_model import WorkerRecord
from slurm_elastic.core.lifecycle import Worker
from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.slurm.parse import StepInfo
from slurm_elastic.status_view import render_status
from tests.stub_backend import ListedSteps

JOB = 7


def worker(wid: str, state: str = "ACTIVE", gpu: int = 0, step: str = "1") -> dict[str, Any]:
    return {**Worker(worker_id=wid, step_id=step, node="node1", gpus=(gpu,), launched_at_s=100.0).to_json(),
            "state": state, "history": [[100.0, "", "STARTING", "launched"]]}


def good_state() -> dict[str, Any]:
    """Two workers, an operator cordon, a manual target of 3 (paused)."""
    return {
        "workers": {"0001": worker("0001", gpu=0, step="1"), "0002": worker("0002", gpu=1, step="2")},
        "next_number": 3, "target_workers": 3, "manual_target": 3, "paused": True, "wake_all_active": False,
        "cordons": {"version": 1, "heard_s": {"node1": 90.0}, "gpus": [
            {"node": "node1", "gpu": 3, "healthy_since_s": None, "crashes_s": [], "preflight_required_mb": 0,
             "entries": [{"reason": "fan noise", "since_s": 95.0, "source": "operator"}]}]},
        "autoscaler": {"integral": 0.5, "votes": 1, "votes_dir": 1, "window": [[90.0, 1.0]]},
    }


def write(tmp: Path, state: Any, version: Any = 1, **header: Any) -> Path:
    path = tmp / "state.json"
    path.write_text(json.dumps({"format": STATE_FORMAT, "version": version, "job_id": JOB, "saved_at": 1.0,
                                "state": state, **header}))
    return path


def start(tmp: Path) -> Controller:
    """A controller over ``tmp`` whose Slurm lists the two workers' steps; it ticks twice."""
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0, "enable_elastic": False}})
    steps = [StepInfo(JOB, s, worker_step_name(w), ("node1",), "0:01", "", "gres/gpu:1", 1)
             for w, s in (("0001", "1"), ("0002", "2"))]
    ctl = Controller(config, JOB, ListedSteps(steps), tmp,  # type: ignore[arg-type]
                     gpus_by_node={"node1": (0, 1, 2, 3)}, clock=lambda: 200.0)
    ctl.tick()
    ctl.tick()
    return ctl


def operator_kept(ctl: Controller) -> bool:
    cordons = ctl.status()["cordoned_gpus"]
    return ctl.state.manual_target == 3 and [(c["node"], c["gpu"], c["reason"]) for c in cordons] == [
        ("node1", 3, "fan noise")]


def test_a_good_file_is_restored_whole_without_notes(tmp_path: Path) -> None:
    write(tmp_path, good_state())
    ctl = start(tmp_path)
    assert operator_kept(ctl) and set(ctl.workers) == {"0001", "0002", "0003"} and ctl.state.next_number == 4
    assert ctl.status()["state_notes"] == [] and ctl.state.autoscaler.integral == 0.5


@pytest.mark.parametrize(("damage", "says"), [
    (lambda s: s["workers"]["0002"].update(state="ZOMBIE"), "dropped 1 unreadable worker record(s): '0002'"),
    (lambda s: s["workers"]["0002"].update(gpus=["x"]), "dropped 1 unreadable worker record(s): '0002'"),
    (lambda s: s["workers"].update({"0009": worker("0001")}), "record of '0001' filed under '0009'"),
    (lambda s: s.update(next_number="x"), "next_number 'x' is not valid"),
    (lambda s: s.update(target_workers=None), "target_workers None is not valid"),
    (lambda s: s.update(workers=[1, 2]), "workers is not an object"),
    (lambda s: s.update(autoscaler={"votes": "many"}), "autoscaler memory is not valid (votes"),
    (lambda s: s.update(paused="yes"), "paused 'yes' is not valid"),
])
def test_a_bad_section_or_record_is_dropped_alone_and_said(tmp_path: Path, damage: Any, says: str) -> None:
    state = good_state()
    damage(state)
    path = write(tmp_path, state)
    ctl = start(tmp_path)
    notes = ctl.status()["state_notes"]
    assert any(says in n for n in notes), notes
    assert operator_kept(ctl)  # the operator's cordon and manual target survive
    assert ctl.ticks == 2 and not [e for e in ctl.errors if e["where"] == "tick"]
    assert {"0001", "0002"} <= set(ctl.workers)  # running steps are adopted, whatever their record said
    assert ctl.state.next_number > 2  # never reuses a worker id
    kept = [p for p in tmp_path.glob("state.json.partial-*")]
    assert len(kept) == 1 and json.loads(kept[0].read_text())["state"] == state  # the file as it was
    assert json.loads(path.read_text())["state"]["manual_target"] == 3  # the next save keeps what was kept


def test_a_manual_target_that_is_not_a_number_is_dropped_and_said(tmp_path: Path) -> None:
    write(tmp_path, {**good_state(), "manual_target": "3"})
    ctl = start(tmp_path)
    assert ctl.state.manual_target is None and ctl.ticks == 2
    assert any("manual_target '3' is not valid" in n for n in ctl.status()["state_notes"])
    assert ctl.status()["cordoned_gpus"][0]["reason"] == "fan noise"


def test_a_bad_cordon_entry_is_dropped_alone(tmp_path: Path) -> None:
    state = good_state()
    state["cordons"]["gpus"].append({"node": "node1", "gpu": 2, "entries": [{"reason": "x", "since_s": "soon",
                                                                              "source": "operator"}]})
    write(tmp_path, state)
    ctl = start(tmp_path)
    assert operator_kept(ctl)
    assert any("cordons: dropped 1 unreadable GPU entry: 'node1:2'" in n for n in ctl.status()["state_notes"])


def test_a_newer_file_keeps_what_this_version_knows_and_says_so(tmp_path: Path) -> None:
    write(tmp_path, {**good_state(), "placement_groups": {"a": 1}}, version=2, extra_header={"x": 1})
    ctl = start(tmp_path)
    assert operator_kept(ctl) and {"0001", "0002"} <= set(ctl.workers)
    notes = ctl.status()["state_notes"]
    assert "newer than this controller's (1)" in notes[0] and "kept as state.json.newer-" in notes[-1]
    assert list(tmp_path.glob("state.json.newer-*"))


@pytest.mark.parametrize(("text", "says"), [
    ("{half a fi", "is corrupt (not JSON"),
    ("[1, 2]", "is not a slurm-elastic controller state file"),
    (json.dumps({"format": STATE_FORMAT, "version": 1, "job_id": "7", "state": {}}), "belongs to job '7', not 7"),
    (json.dumps({"format": STATE_FORMAT, "version": "1", "job_id": JOB, "state": {}}), "has version '1'"),
    (json.dumps({"format": STATE_FORMAT, "version": 1, "job_id": JOB, "state": None}), "has no state object"),
])
def test_a_file_that_is_not_this_jobs_state_is_moved_aside(tmp_path: Path, text: str, says: str) -> None:
    (tmp_path / "state.json").write_text(text)
    ctl = start(tmp_path)
    notes = ctl.status()["state_notes"]
    assert len(notes) == 2 and says in notes[0] and "moved to state.json.corrupt-" in notes[0], notes
    assert "cordons, a manual target or a pause set before are not known" in notes[1]
    assert ctl.state.target_workers == 2 and set(ctl.workers) == {"0001", "0002"}  # the running fleet is kept
    assert list(tmp_path.glob("state.json.corrupt-*"))


def test_status_json_and_table_show_the_notes(tmp_path: Path) -> None:
    state = good_state()
    state["workers"]["0002"]["state"] = "\x1b[31mZOMBIE"
    write(tmp_path, state)
    status = start(tmp_path).status()
    assert status["state_note"] == "; ".join(status["state_notes"]) and status["state_notes"]
    text = render_status(JOB, status)
    assert "saved state: state.json: dropped 1 unreadable worker record(s): '0002'" in text
    assert "saved state: the file as it was is kept as state.json.partial-" in text
    assert "\x1b" not in text


def test_the_record_model_has_every_field_of_a_worker() -> None:
    assert set(WorkerRecord.model_fields) == set(Worker.__dataclass_fields__)


@pytest.mark.parametrize("damage", ["delete", "truncate", "directory"])
def test_a_lost_or_damaged_file_falls_back_to_the_state_the_last_save_replaced(tmp_path: Path, damage: str) -> None:
    """Found by a crash audit: with ``state.json`` deleted or cut short, the operator's cordon and
    manual target were dropped without a word, and the autoscaler then scaled against them."""
    write(tmp_path, good_state())
    first = start(tmp_path)
    first.save()  # the state as loaded goes to state.json.previous, this save's to state.json
    path = tmp_path / "state.json"
    assert (tmp_path / "state.json.previous").is_file()
    if damage == "delete":
        path.unlink()
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.unlink()
        path.mkdir()
    ctl = start(tmp_path)
    notes = ctl.status()["state_notes"]
    assert operator_kept(ctl) and {"0001", "0002"} <= set(ctl.workers)
    assert any("restored from state.json.previous" in n for n in notes), notes


def test_with_neither_file_the_steps_are_kept_and_the_log_says_what_is_not_known(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write(tmp_path, good_state())
    start(tmp_path).save()
    for name in ("state.json", "state.json.previous"):
        (tmp_path / name).unlink()
    with caplog.at_level(logging.INFO):
        ctl = start(tmp_path)
    assert ctl.state.target_workers == 2 and ctl.state.manual_target is None
    said = ("no saved state: keeping the 2 worker steps Slurm runs; cordons, a manual target or a pause set "
            "before are not known (set them again)")
    assert said in caplog.text and said in ctl.status()["state_notes"]
