"""What the controller answers an operator when the command cannot do what it says: a drain of a
worker that has no step says what state it is in and why, rather than a bare "unknown" (an operator
copies ids from a status a moment old); a resume with the autoscaler disabled says nothing will scale."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller, UnknownWorkerError
from slurm_elastic.core.lifecycle import Worker, WorkerState
from slurm_elastic.slurm.cli_backend import SlurmCli


def test_a_finished_worker_is_named_with_its_state_and_an_unknown_one_with_where_to_look(tmp_path: Path) -> None:
    ctl = Controller(parse_config({"agent": {"enabled": False}}), 7, SlurmCli(), tmp_path / "state",
                     gpus_by_node={"n1": (0, 1)})
    done = Worker("0004", launched_at_s=0.0)
    done.state = WorkerState.INACTIVE
    done.history.append((5.0, "DRAINING", "INACTIVE", "step ended after drain"))
    ctl.state.workers["0004"] = done
    with pytest.raises(UnknownWorkerError, match=r"0004: no step runs for it, nothing to drain \(it is INACTIVE: "
                                                 r"step ended after drain\)"):
        ctl.drain("0004")
    with pytest.raises(UnknownWorkerError, match=r"9999: no worker of that id in job 7 \(`slurm-elastic status 7`"):
        ctl.drain("9999")


def test_resume_with_the_autoscaler_disabled_says_nothing_will_scale(tmp_path: Path) -> None:
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"enabled": False}})
    ctl = Controller(config, 7, SlurmCli(), tmp_path / "state", gpus_by_node={"n1": (0, 1)})
    answer = ctl.resume()
    assert answer["paused"] is False and "[autoscaler] enabled = false" in answer["note"]
    on = Controller(parse_config({"agent": {"enabled": False}}), 7, SlurmCli(), tmp_path / "on", gpus_by_node={"n1": (0,)})
    assert on.resume() == {"paused": False}


def test_a_pause_under_wake_all_or_a_manual_target_says_what_holds_the_count(tmp_path: Path) -> None:
    ctl = Controller(parse_config({"agent": {"enabled": False}}), 7, SlurmCli(), tmp_path / "state",
                     gpus_by_node={"n1": (0, 1)})
    assert ctl.pause() == {"paused": True}
    ctl.wake_all()
    answer = ctl.pause()  # before, {"paused": true} alone, and status still read "(wake-all)"
    assert answer["paused"] is True and answer["note"].startswith("wake-all holds the count already")
    ctl.scale(1)
    assert "the manual target 1 holds the count already" in ctl.pause()["note"]
