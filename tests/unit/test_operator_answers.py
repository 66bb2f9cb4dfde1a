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


def test_a_cordon_says_what_it_leaves_running_the_trainer_and_a_worker_on_that_gpu(tmp_path: Path) -> None:
    """A cordon keeps new workers off; the trainer's GPU (Slurm names how many the job's other steps
    hold, not which) and a worker's keep running, and the answer says so."""
    from slurm_elastic.commands.said import said

    ctl = Controller(parse_config({"agent": {"enabled": False}}), 7, SlurmCli(), tmp_path / "state",
                     gpus_by_node={"n1": (0, 1, 2, 3)})
    ctl.state.foreign_gpus = {7: {"n1": 1}}  # the trainer's step holds one GPU of n1
    for number, gpu in (("0001", 1), ("0002", 2), ("0003", 3)):
        ctl.state.workers[number] = Worker(number, state=WorkerState.ACTIVE, node="n1", gpus=(gpu,))
    trainer = ctl.cordon("n1", 0, "fan")
    assert trainer["cordoned"] is True and "trainer keeps running on it" in trainer["note"]
    assert "hold 1 GPU(s) of n1 and it is one of them" in trainer["note"]
    assert "note: the job's other steps (the trainer's)" in said("cordon", 7, trainer)
    worker = ctl.cordon("n1", 2, "")
    assert "worker 0002 runs on n1:2 and keeps running" in worker["note"]
    del ctl.state.workers["0003"]  # two GPUs free, one the trainer's: n1:3 may be it
    assert "so it may be one of them" in ctl.cordon("n1", 3, "")["note"]
    ctl.state.foreign_gpus = {}
    assert "note" not in ctl.cordon("n1", 3, "")  # no other step there: nothing to add
