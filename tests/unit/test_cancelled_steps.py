"""A worker step cancelled by someone else than the controller (``scancel J.S``): Slurm's CANCELLED
line in the step's output marks it, and the worker is relaunched without a crash on its GPU. The
real scancel is in tests/cluster/test_operator_scancel.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import (
    Controller,
    srun_log_says_terminated,
    step_output_says_cancelled,
)
from slurm_elastic.core.defaults import STEP_END_SETTLE_S
from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.slurm.parse import StepInfo
from tests.stub_backend import ListedSteps

CANCELLED = "slurmstepd-node1: error: *** STEP 7.3 ON node1 CANCELLED AT 2026-11-26T05:23:19 ***\n"


def test_the_cancelled_line_of_this_step_and_no_other(tmp_path: Path) -> None:
    out = tmp_path / "worker-0001.out"
    assert not step_output_says_cancelled(out, "7.3")  # no output at all
    out.write_text("x" * 10_000 + "\n" + CANCELLED)
    assert step_output_says_cancelled(out, "7.3")
    assert not step_output_says_cancelled(out, "7.30") and not step_output_says_cancelled(out, "8.3")


SRUN_TERMINATING = ("srun: launch/slurm: _step_signal: Terminating StepId=7.3\n"
                    "srun: Job step aborted: Waiting up to 7 seconds for job step to finish.\n")


def test_sruns_own_line_of_this_step_and_no_other(tmp_path: Path) -> None:
    log = tmp_path / "0001.log"
    assert not srun_log_says_terminated(log, "7.3")  # no log at all
    log.write_text("srun: launch/slurm: _step_signal: Terminating StepId=7.30\n" + SRUN_TERMINATING)
    assert srun_log_says_terminated(log, "7.3")
    assert not srun_log_says_terminated(log, "8.3") and not srun_log_says_terminated(log, "7.31")


def test_sruns_line_after_a_failed_task_is_a_crash_not_a_cancel(tmp_path: Path) -> None:
    """Seen on the dev cluster: a wrapper that exited 1 while the controller was down (no exit code
    reported); srun then ended the step itself (``--kill-on-bad-exit``)."""
    log = tmp_path / "0001.log"
    log.write_text("srun: error: node1: task 0: Exited with exit code 1\n" + SRUN_TERMINATING.replace("7.3", "27.0"))
    assert not srun_log_says_terminated(log, "27.0")
    log.write_text("srun: error: node1: task 0: Exited with exit code 1\n" + SRUN_TERMINATING.replace("7.3", "27.0")
                   + SCANCELLED_22_05.replace("3601.1", "27.3"))
    assert srun_log_says_terminated(log, "27.3")  # the relaunched step, cancelled, in the same log


SCANCELLED_22_05 = ("srun: Job step aborted: Waiting up to 7 seconds for job step to finish.\n"  # scancel 3601.1
                    "srun: error: node2: task 0: Killed\nsrun: launch/slurm: _step_signal: Terminating StepId=3601.1\n")
WRAPPER_KILLED_22_05 = ("srun: error: node2: task 0: Killed\n"  # kill -9 of the wrapper on its node (a live audit)
                        "srun: launch/slurm: _step_signal: Terminating StepId=3601.2\nsrun: Force Terminated StepId=3601.2\n")


def test_a_wrapper_killed_on_its_node_is_a_crash_and_a_scancel_of_its_step_is_not(tmp_path: Path) -> None:
    """Before, a kill -9 of the wrapper read as an operator's cancel: relaunched at once, not counted."""
    log = tmp_path / "0002.log"
    log.write_text("slurm-elastic: spawned srun\n" + WRAPPER_KILLED_22_05)
    assert not srun_log_says_terminated(log, "3601.2")
    log.write_text("slurm-elastic: spawned srun\n" + SCANCELLED_22_05)
    assert srun_log_says_terminated(log, "3601.1")


SLURM_25_11 = {  # what Slurm 25.11.7 wrote for `scancel 30.0` of a running step (docs/real-cluster.md)
    "srun": "srun: Job step aborted: Waiting up to 7 seconds for job step to finish.\n"
            "srun: error: pnode1: task 0: Killed\nsrun: Terminating StepId=30.0\n",
    "step": "[2026-11-26T15:14:14.624] error: *** STEP 30.0 ON pnode1 CANCELLED AT 2026-11-26T15:14:14 "
            "DUE to SIGNAL Killed ***\n",
}


def test_slurm_25_11s_lines_for_a_cancelled_step_read_the_same(tmp_path: Path) -> None:
    (tmp_path / "srun.log").write_text(SLURM_25_11["srun"])
    (tmp_path / "step.out").write_text(SLURM_25_11["step"])
    assert srun_log_says_terminated(tmp_path / "srun.log", "30.0")
    assert step_output_says_cancelled(tmp_path / "step.out", "30.0")
    assert not srun_log_says_terminated(tmp_path / "srun.log", "30.1")


def test_a_step_cancelled_while_starting_with_only_sruns_word_is_not_counted(tmp_path: Path) -> None:
    """Seen on CI: ``scancel J.S`` right after a worker registered; slurmstepd wrote no CANCELLED
    line to the step's output in time, srun's log of the step said it was cancelled."""
    clock = Clock()
    controller, worker_id = a_step_that_left(tmp_path, clock)
    (tmp_path / "logs" / "srun").mkdir(parents=True, exist_ok=True)
    (tmp_path / "logs" / "srun" / f"{worker_id}.log").write_text(SRUN_TERMINATING)
    clock.now_s += 1
    controller.tick()
    worker = controller.workers[worker_id]
    assert worker.crash_count == 0 and worker.launches == 2 and controller.cordoned_gpus() == {}
    assert "cancelled by someone else" in worker.history[-3][3]


def test_a_step_whose_srun_was_killed_is_relaunched_and_not_counted(tmp_path: Path) -> None:
    """kill -9 of a worker's srun: its shepherd cancels the step, and neither slurmstepd nor srun
    says so; the reaper's line in srun's log does (before, a crash of its GPU)."""
    clock = Clock()
    controller, worker_id = a_step_that_left(tmp_path, clock)
    (tmp_path / "logs" / "srun").mkdir(parents=True, exist_ok=True)
    (tmp_path / "logs" / "srun" / f"{worker_id}.log").write_text(
        "slurm-elastic: spawned srun\nslurm-elastic: srun (pid 21386) was killed by signal 9 (SIGKILL)\n")
    clock.now_s += 1
    controller.tick()
    worker = controller.workers[worker_id]
    assert worker.crash_count == 0 and worker.launches == 2 and controller.cordoned_gpus() == {}
    assert "its srun killed" in worker.history[-3][3]


def cancel_the_step(tmp_path: Path, exit_code: int | None, terminated: bool = False,
                    nodes: tuple[str, ...] = ("node1",), other_task_exit: int | None = None) -> Controller:
    """A worker's step on ``nodes`` leaves the listing with Slurm's CANCELLED line in its output,
    after its wrapper reported ``exit_code`` (None: none, as when scancel kills it outright), and
    whether a SIGTERM came before it; ``other_task_exit``: task 1 reported its command's failure first."""
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    backend = ListedSteps()
    controller = Controller(config, 7, backend, tmp_path, gpus_by_node={"node1": (0, 1)})  # type: ignore[arg-type]
    controller.scale(1)
    controller.tick()
    (worker_id,) = controller.workers
    backend.steps = [StepInfo(7, "3", worker_step_name(worker_id), nodes, "0:01", "", "gres/gpu:1", 1)]
    controller.tick()
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "logs" / f"worker-{worker_id}.out").write_text(CANCELLED)
    if other_task_exit is not None:
        controller.heartbeat(worker_id, {"rank": 1, "exit_code": other_task_exit})
    heartbeat: dict[str, object] = {} if exit_code is None else {"exit_code": exit_code}
    if terminated:
        heartbeat["terminated_by_signal"] = True
    if heartbeat:
        controller.heartbeat(worker_id, heartbeat)
    backend.steps = []
    controller.tick()
    return controller


def test_a_step_cancelled_by_hand_is_relaunched_and_not_counted(tmp_path: Path) -> None:
    controller = cancel_the_step(tmp_path, exit_code=None)
    (worker,) = controller.workers.values()
    assert worker.crash_count == 0 and worker.launches == 2 and controller.cordoned_gpus() == {}
    assert "cancelled by someone else" in worker.history[-3][3]


def test_a_step_srun_ended_after_a_task_failed_is_a_crash(tmp_path: Path) -> None:
    controller = cancel_the_step(tmp_path, exit_code=241)  # the wrapper's command, stopped by srun
    (worker,) = controller.workers.values()
    assert worker.crash_count == 1 and worker.state.value == "BACKOFF"


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def a_step_that_left(tmp_path: Path, clock: Clock) -> tuple[Controller, str]:
    """A worker whose step was listed, then left the listing with no word from its wrapper."""
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    backend = ListedSteps()
    controller = Controller(config, 7, backend, tmp_path, gpus_by_node={"node1": (0, 1)},  # type: ignore[arg-type]
                            clock=clock)
    controller.scale(1)
    controller.tick()
    (worker_id,) = controller.workers
    backend.steps = [StepInfo(7, "3", worker_step_name(worker_id), ("node1",), "0:01", "", "gres/gpu:1", 1)]
    controller.tick()
    backend.steps = []
    clock.now_s += 1
    controller.tick()
    return controller, worker_id


def test_the_cancelled_line_written_after_the_step_left_the_listing_still_counts(tmp_path: Path) -> None:
    """srun writes Slurm's line on its own time: the listing can change first (seen on a loaded
    2-core machine). The worker waits STEP_END_SETTLE_S for it before it counts as a crash."""
    clock = Clock()
    controller, worker_id = a_step_that_left(tmp_path, clock)
    worker = controller.workers[worker_id]
    assert worker.state.value == "STARTING" and worker.crash_count == 0 and worker.vanished_at_s == 101

    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "logs" / f"worker-{worker_id}.out").write_text(CANCELLED)
    clock.now_s += 1
    controller.tick()
    assert worker.crash_count == 0 and worker.launches == 2 and controller.cordoned_gpus() == {}
    assert "cancelled by someone else" in worker.history[-3][3]


def test_a_step_gone_without_a_word_is_a_crash_once_slurm_had_time_to_say_why(tmp_path: Path) -> None:
    clock = Clock()
    controller, worker_id = a_step_that_left(tmp_path, clock)
    clock.now_s += STEP_END_SETTLE_S
    controller.tick()
    worker = controller.workers[worker_id]
    assert worker.crash_count == 1 and worker.state.value == "BACKOFF"
    assert "step ended unexpectedly" in worker.history[-2][3]


def test_a_one_task_step_sent_sigterm_by_hand_is_not_counted(tmp_path: Path) -> None:
    controller = cancel_the_step(tmp_path, exit_code=-15, terminated=True)  # scancel --signal=TERM J.S
    (worker,) = controller.workers.values()
    assert worker.crash_count == 0 and worker.launches == 2 and not worker.terminated_by_signal


def test_a_step_of_two_nodes_sent_sigterm_by_hand_is_not_counted(tmp_path: Path) -> None:
    controller = cancel_the_step(tmp_path, exit_code=-15, terminated=True, nodes=("node1", "node2"))
    (worker,) = controller.workers.values()
    assert worker.crash_count == 0 and worker.launches == 2


@pytest.mark.parametrize("rank_0_exit", [-15, 0])
def test_a_step_of_two_nodes_ended_by_srun_after_its_other_task_failed_counts(tmp_path: Path,
                                                                              rank_0_exit: int) -> None:
    """srun sends SIGTERM to the other tasks of a step one of whose tasks failed, which rank 0 cannot
    tell from an operator's; the failed task reported first, so the end is a crash, even where rank
    0's command took the SIGTERM as a clean stop (exit 0)."""
    controller = cancel_the_step(tmp_path, exit_code=rank_0_exit, terminated=True, nodes=("node1", "node2"),
                                 other_task_exit=9)
    (worker,) = controller.workers.values()
    assert worker.crash_count == 1
    assert "its task 1 exited with code 9" in worker.history[-2][3]


def test_a_one_task_step_whose_command_failed_by_itself_counts(tmp_path: Path) -> None:
    controller = cancel_the_step(tmp_path, exit_code=3)  # no SIGTERM before it: its own failure
    (worker,) = controller.workers.values()
    assert worker.crash_count == 1
