"""Two SDK processes under one worker id: the controller tells them apart by the instance and the
Slurm step each sends with its counts, and never refuses either. Counts it can tell are not the
worker's current process's (a process of another step than the worker's; a second process of
the worker's step while the holder was heard within the heartbeat grace) are not applied: the
answer says so (``counts_applied`` false, ``counts_note``), the SDK logs it once as a warning,
and both processes keep running. A relaunched worker's new process, the first process of the
current step after a controller restart, and an SDK that sends no instance are counted."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_elastic.client.control import ControlClient
from slurm_elastic.controller.files import publish
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.lifecycle import Worker, WorkerState, transition
from slurm_elastic.core.reconcile import ObservedStep, Plan, _adopt_and_refresh
from slurm_elastic.core.registration import CountsClaim, counts_note
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.worker import RolloutWorker
from tests.unit.served_controller import ServedController

TOKEN = "duplicate-token"
GRACE_S = 1.0
CONFIG = {"autoscaler": {"min_workers": 0}, "workers": {"heartbeat_interval_s": 0.2, "heartbeat_grace_s": GRACE_S}}
NOT_COUNTED = "the controller did not count this process's rollouts"


def test_the_rule() -> None:
    claim = CountsClaim("a", "9.3", heard_s=100.0)
    assert counts_note("0001", None, "a", "9.3", "9.3", 100.0, 60.0) == ""  # nothing claimed yet
    assert counts_note("0001", claim, "a", "9.3", "9.3", 101.0, 60.0) == ""  # its own beat
    said = counts_note("0001", claim, "b", "9.3", "9.3", 130.0, 60.0)
    assert said.startswith("another process of this step already reports for worker 0001 (heard 30 s ago), so this "
                           "process's rollout counts and busy time are not counted"), said
    assert "it keeps running" in said and "workers.heartbeat_grace_s (60 s)" in said
    assert counts_note("0001", claim, "b", "9.3", "9.3", 160.0, 60.0) == ""  # silent for the grace: taken as gone
    assert counts_note("0001", claim, "b", "9.4", "9.4", 130.0, 60.0) == ""  # a relaunch: a new step, a new process
    assert counts_note("0001", replace(claim, instance=""), "b", "9.3", "9.3", 101.0, 60.0) == ""  # it closed
    assert counts_note("0001", claim, "", "", "9.3", 101.0, 60.0) == ""  # an SDK that says neither: as before
    old = counts_note("0001", None, "a", "9.3", "9.7", 100.0, 60.0)
    assert old.startswith("this process runs in step 9.3, an earlier launch of worker 0001; the worker now runs as "
                          "step 9.7, so this process's rollout counts and busy time are not the worker's"), old
    # the record's step not known yet (relaunched, not registered): counts apply, as from any process
    assert counts_note("0001", None, "a", "9.3", "", 100.0, 60.0) == ""


def test_a_step_adopted_again_keeps_its_launch_count_and_its_step() -> None:
    """A burst job's step not listed for a few seconds: the record went FAILED with its step
    forgotten, and the next good listing adopts the same step: its process's counts apply."""
    workers = {"0001": Worker("0001", WorkerState.ACTIVE, job_id=7, step_id="3", launches=1)}
    transition(workers["0001"], WorkerState.FAILED, 10.0, "its step left the listing")
    workers["0001"].step_id = ""
    _adopt_and_refresh(workers, {"0001": ObservedStep("0001", "3", "node1", 7)}, 20.0, Plan())
    adopted = workers["0001"]
    assert (adopted.state, adopted.step_id, adopted.launches) == (WorkerState.STARTING, "3", 1)
    assert counts_note("0001", None, "x", "7.3", f"{adopted.job_id}.{adopted.step_id}", 20.0, 60.0) == ""


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ServedController:
    server = ServedController(tmp_path, TOKEN, CONFIG).launched("0001")
    publish(tmp_path, server.url, 1)
    server.controller.register_worker("0001", {"node": "node1", "gpus": [0], "step_id": "3"})
    for name, value in {"SLURM_ELASTIC_WORKER_ID": "0001", "SLURM_ELASTIC_CONTROLLER_URL": server.url,
                        "SLURM_ELASTIC_TOKEN": TOKEN, "SLURM_ELASTIC_STATE_DIR": str(tmp_path),
                        "SLURM_ELASTIC_HEARTBEAT_INTERVAL_S": "0.2", "SLURM_JOB_ID": "1",
                        "SLURM_STEP_ID": "3"}.items():
        monkeypatch.setenv(name, value)
    return server


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and NOT_COUNTED in r.getMessage()]


def test_two_live_processes_in_one_step_both_run_and_only_the_first_counts(
        served: ServedController, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    try:
        with RolloutWorker.from_env() as first:
            for _ in range(3):
                with first.rollout():
                    pass
            deadline = time.monotonic() + 10
            while "0001" not in served.controller.counts_claims and time.monotonic() < deadline:
                time.sleep(0.05)  # the first has beaten: it holds the counts
            started = time.monotonic()
            with RolloutWorker.from_env() as second:  # never refused, and start() does not wait
                assert time.monotonic() - started < 0.5
                with second.rollout():
                    pass
                time.sleep(0.7)  # a few beats of each
                assert served.controller.state.workers["0001"].rollouts == 3  # the first's, never the second's 1
                assert served.controller.counts_claims["0001"].instance == first.beats.instance
                assert second.admit(1, wait=False) == 1 and first.admit(1, wait=False) == 1  # both keep running
                assert second.give_back(1) == 1
                said = _warnings(caplog)
                assert len(said) == 1 and "another process of this step already reports for worker 0001" in said[0]
        with RolloutWorker.from_env() as after:  # both closed: the next process counts at once
            with after.rollout():
                pass
            time.sleep(0.5)
            assert served.controller.state.workers["0001"].rollouts == 1
    finally:
        served.close()


def test_the_warning_is_told_again_only_after_counts_were_applied(
        served: ServedController, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    try:
        worker = RolloutWorker.from_env()
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"instance": "holder", "step": "1.3"})
            worker.beats.beat()
            worker.beats.beat()
            assert len(_warnings(caplog)) == 1
            client.heartbeat("0001", {"instance": "holder", "step": "1.3", "closing": True})
            worker.beats.beat(closing=True)  # counted now, and it lets go
            assert len(_warnings(caplog)) == 1
            client.heartbeat("0001", {"instance": "holder", "step": "1.3"})  # the other holds the counts again
            worker.beats.beat()
            assert len(_warnings(caplog)) == 2
        worker.close()
    finally:
        served.close()


def test_a_straggler_of_an_earlier_step_runs_on_uncounted_and_takes_nothing(served: ServedController) -> None:
    """The worker crashed and was launched again (its record names step 1.4, STARTING) while its old
    process (step 1.3) still beats: the old one's counts are not applied, its answer says why and
    never asks it to register (which would hand the record to its step), and it keeps running."""
    try:
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"rollouts": 40, "instance": "old", "step": "1.3"})
            worker = served.controller.state.workers["0001"]
            worker.state, worker.step_id = WorkerState.STARTING, "4"  # launched again, its step registered
            answer = client.heartbeat("0001", {"rollouts": 41, "busy": True, "instance": "old", "step": "1.3"})
            assert answer["counts_applied"] is False and answer["register"] is False, answer
            assert "runs in step 1.3, an earlier launch of worker 0001; the worker now runs as step 1.4" in answer[
                "counts_note"]
            assert (worker.rollouts, worker.busy, worker.step_id) == (40, False, "4")
            assert client.heartbeat("0001", {"busy": False})["register"] is True  # the new step's wrapper: as before
            answer = client.heartbeat("0001", {"rollouts": 0, "instance": "new", "step": "1.4"})
            assert "counts_applied" not in answer and worker.rollouts == 0  # the new step's process: counted at once
            claim = served.controller.counts_claims["0001"]
            served.controller.counts_claims["0001"] = replace(claim, heard_s=claim.heard_s - 10 * GRACE_S)
            assert client.heartbeat("0001", {"rollouts": 42, "instance": "old", "step": "1.3"})["counts_applied"] is False
            assert worker.rollouts == 0 and worker.step_id == "4"  # the new one silent: still not the old one's
    finally:
        served.close()


def test_an_sdk_straggler_keeps_running(served: ServedController, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SDK process of an earlier step: no error from start(), its heartbeats or its calls."""
    try:
        served.controller.state.workers["0001"].step_id = "4"
        with RolloutWorker.from_env() as straggler:  # SLURM_STEP_ID 3
            with straggler.rollout():
                pass
            time.sleep(0.5)
            assert straggler.beats.thread.is_alive() and straggler.admit(1, wait=False) == 1
            assert served.controller.state.workers["0001"].rollouts == 0
    finally:
        served.close()


def test_a_relaunched_workers_new_process_is_counted(served: ServedController) -> None:
    """Between the relaunch and the new step's registration the record's step is not known: counts
    apply as from any process (the straggler's too). Once the new step registered, its process is
    counted at once and the straggler's are not."""
    try:
        controller = served.controller
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"rollouts": 7, "instance": "old", "step": "1.3"})
            worker = controller.state.workers["0001"]
            worker.step_id = ""  # relaunched, not registered yet
            answer = client.heartbeat("0001", {"rollouts": 8, "instance": "old", "step": "1.3"})
            assert "counts_applied" not in answer and worker.rollouts == 8
            controller.register_worker("0001", {"node": "node1", "gpus": [0], "step_id": "4"})
            assert worker.step_id == "4"
            assert "counts_applied" not in client.heartbeat("0001", {"rollouts": 1, "instance": "new", "step": "1.4"})
            assert worker.rollouts == 1
            assert client.heartbeat("0001", {"rollouts": 9, "instance": "old", "step": "1.3"})["counts_applied"] is False
            assert worker.rollouts == 1
    finally:
        served.close()


def test_after_a_controller_restart_the_first_process_of_the_step_counts(served: ServedController,
                                                                         tmp_path: Path) -> None:
    """Claims are not saved: after a restart the first process of the current step to beat holds
    the counts, a second one of that step is not counted, nor one of an earlier step."""
    try:
        served.controller.state.workers["0001"].step_id = "4"
        served.controller.save()
        restarted = Controller(served.controller.config, 1, SlurmCli(timeout_s=5), tmp_path,
                               gpus_by_node={"node1": (0, 1)})
        assert restarted.heartbeat("0001", {"rollouts": 40, "instance": "old", "step": "1.3"})["counts_applied"] is False
        assert "counts_applied" not in restarted.heartbeat("0001", {"rollouts": 2, "instance": "new", "step": "1.4"})
        second = restarted.heartbeat("0001", {"rollouts": 5, "instance": "other", "step": "1.4"})
        assert second["counts_applied"] is False and second["drain"] is False
        assert restarted.state.workers["0001"].rollouts == 2
    finally:
        served.close()


def test_the_route_answers_the_same(served: ServedController) -> None:
    """The heartbeat's fast path answers when the lock is free; with a tick holding it, the route."""
    try:
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"instance": "one", "step": "1.3"})
            held, release = threading.Event(), threading.Event()

            def tick_holding_the_lock() -> None:
                with served.controller.lock:
                    held.set()
                    release.wait(5)

            holder = threading.Thread(target=tick_holding_the_lock)
            holder.start()
            held.wait(5)
            threading.Timer(0.3, release.set).start()
            answer = client.heartbeat("0001", {"rollouts": 3, "instance": "two", "step": "1.3"})
            holder.join()
            assert answer["counts_applied"] is False and "another process" in answer["counts_note"]
            assert served.controller.state.workers["0001"].rollouts == 0
    finally:
        served.close()


def test_a_holder_that_closed_or_went_silent_lets_the_next_count(served: ServedController) -> None:
    try:
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"rollouts": 5, "instance": "gone", "step": "1.3"})  # then killed: no closing beat
            assert client.heartbeat("0001", {"rollouts": 1, "instance": "next", "step": "1.3"})["counts_applied"] is False
            time.sleep(GRACE_S + 0.1)
            assert "counts_applied" not in client.heartbeat("0001", {"rollouts": 1, "instance": "next", "step": "1.3"})
            client.heartbeat("0001", {"rollouts": 2, "instance": "next", "step": "1.3", "closing": True})
            assert "counts_applied" not in client.heartbeat("0001", {"rollouts": 0, "instance": "third", "step": "1.3"})
            assert served.controller.state.workers["0001"].rollouts == 0
    finally:
        served.close()


def test_an_older_sdk_is_counted_as_before(served: ServedController) -> None:
    try:
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"rollouts": 5, "instance": "holder", "step": "1.3"})
            answer = client.heartbeat("0001", {"rollouts": 6, "busy": True, "busy_s": 1.0})  # neither field
            assert "counts_applied" not in answer
            assert (served.controller.state.workers["0001"].rollouts, served.controller.state.workers["0001"].busy) == (
                6, True)
    finally:
        served.close()


class Paused:
    """A pause watch that says how long the controller did not run."""

    def __init__(self) -> None:
        self.lost_s = 0.0

    def lost_total_s(self) -> float:
        return self.lost_s


def test_a_pause_of_the_controller_does_not_flip_the_holder(served: ServedController) -> None:
    """Nobody could beat while the controller stood still: the grace runs on a clock the pause does
    not move, so a holder heard just before the pause keeps the counts against a second process
    that beats first after it."""
    try:
        served.controller.pause_watch = Paused()  # type: ignore[assignment]
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"rollouts": 4, "instance": "one", "step": "1.3"})
            claim = served.controller.counts_claims["0001"]
            served.controller.counts_claims["0001"] = replace(claim, heard_s=claim.heard_s - 5 * GRACE_S)
            served.controller.pause_watch.lost_s = 5 * GRACE_S  # type: ignore[union-attr]
            assert client.heartbeat("0001", {"rollouts": 9, "instance": "two", "step": "1.3"})["counts_applied"] is False
            assert "counts_applied" not in client.heartbeat("0001", {"rollouts": 5, "instance": "one", "step": "1.3"})
            assert served.controller.counts_claims["0001"].instance == "one"
            assert served.controller.state.workers["0001"].rollouts == 5
    finally:
        served.close()
