"""Two SDK processes under one worker id: the controller tells them apart by the instance and the
Slurm step each sends with its counts. A process of another step than the worker's (an earlier
launch) is refused for good (409, no Retry-After); a second live one of the worker's step gets
409 with Retry-After and Holder-Beats, which ``start()`` raises as :class:`DuplicateWorkerError`
once the holder's beats move. Before, both were one worker to the controller: its rollout count
and busy time took turns between them. A process that closed, one silent past the heartbeat
grace, a relaunched worker's, one after a controller restart, one whose step was adopted again,
and an SDK that sends no instance are all let in."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_elastic.client.control import ControlClient
from slurm_elastic.controller.control_plane import DuplicateInstanceError
from slurm_elastic.controller.files import publish
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.lifecycle import Worker, WorkerState, transition
from slurm_elastic.core.reconcile import ObservedStep, Plan, _adopt_and_refresh
from slurm_elastic.core.registration import CountsClaim, claim_refusal, next_claim, step_refusal
from slurm_elastic.errors import ApiError, DuplicateWorkerError
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.worker import RolloutWorker
from tests.unit.served_controller import ServedController

TOKEN = "duplicate-token"
GRACE_S = 1.0
CONFIG = {"autoscaler": {"min_workers": 0}, "workers": {"heartbeat_interval_s": 0.2, "heartbeat_grace_s": GRACE_S}}


def test_the_rule() -> None:
    claim = CountsClaim("a", "9.3", heard_s=100.0)
    assert claim_refusal("0001", None, "a", "9.3", 100.0, 60.0) == ""  # nothing claimed yet
    assert claim_refusal("0001", claim, "a", "9.3", 101.0, 60.0) == ""  # its own beat
    said = claim_refusal("0001", claim, "b", "9.3", 130.0, 60.0)
    assert said.startswith("duplicate worker 0001: another process already reports for this worker id (heard 30 s "
                           "ago, 1 beats); two RolloutWorkers under one id would mix their rollout counts"), said
    assert claim_refusal("0001", claim, "b", "9.3", 160.0, 60.0) == ""  # silent for the grace: taken as gone
    assert claim_refusal("0001", claim, "b", "9.4", 130.0, 60.0) == ""  # a relaunch: a new step, a new process
    assert next_claim(claim, "a", "9.3", 110.0) == CountsClaim("a", "9.3", 110.0, beats=2)
    assert next_claim(claim, "b", "9.4", 130.0) == CountsClaim("b", "9.4", 130.0, beats=1)
    closed = next_claim(claim, "a", "9.3", 140.0, closing=True)
    assert closed.instance == "" and claim_refusal("0001", closed, "c", "9.3", 141.0, 60.0) == ""
    # a process of another step than the worker's: refused whatever the claim, stateless
    old = step_refusal("0001", "9.3", "9.7")
    assert old == ("duplicate worker 0001: this process belongs to step 9.3, an earlier launch of worker 0001; the "
                   "worker now runs as step 9.7. Its counts are not taken, and this process should end"), old
    assert step_refusal("0001", "9.7", "9.7") == step_refusal("0001", "", "9.7") == step_refusal("0001", "9.3", "") == ""


def test_a_step_adopted_again_keeps_its_process_and_its_launch_count() -> None:
    """A burst job's step not listed for a few seconds (its GPUs unreadable): the record went FAILED
    with its step forgotten, and the next good listing adopts the same step. Before, the adoption
    counted a new launch, and the step's own live process, holding the claim at the old launch
    number, was refused for good (its heartbeats stopped, its next admit raised: a crash)."""
    workers = {"0001": Worker("0001", WorkerState.ACTIVE, job_id=7, step_id="3", launches=1)}
    transition(workers["0001"], WorkerState.FAILED, 10.0, "its step left the listing")
    workers["0001"].step_id = ""
    _adopt_and_refresh(workers, {"0001": ObservedStep("0001", "3", "node1", 7)}, 20.0, Plan())
    adopted = workers["0001"]
    assert (adopted.state, adopted.step_id, adopted.launches) == (WorkerState.STARTING, "3", 1)
    assert step_refusal("0001", "7.3", f"{adopted.job_id}.{adopted.step_id}") == ""


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


def test_a_second_live_process_is_refused_and_the_first_keeps_its_counts(served: ServedController) -> None:
    try:
        with RolloutWorker.from_env() as first:
            for _ in range(3):
                with first.rollout():
                    pass
            started = time.monotonic()
            with pytest.raises(DuplicateWorkerError) as refused:
                RolloutWorker.from_env().start()  # waits the Retry-After once: the first beats on, so refused
            assert refused.value.status_code == 409 and GRACE_S * 0.5 < time.monotonic() - started < 10
            assert refused.value.detail.startswith("duplicate worker 0001: another process already reports"), refused
            time.sleep(0.5)
            assert served.controller.state.workers["0001"].rollouts == 3  # the first's, never the second's 0
        with RolloutWorker.from_env() as after:  # the first closed: its successor is let in at once
            assert after.beats.instance != first.beats.instance and after.beats.step == "1.3"
    finally:
        served.close()


def test_a_process_that_died_without_closing_is_replaced_after_the_grace(served: ServedController) -> None:
    try:
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"rollouts": 5, "instance": "gone", "step": "1.3"})  # then killed: no closing beat
            started = time.monotonic()
            with RolloutWorker.from_env() as worker:  # refused, the holder's beats still: let in after the grace
                assert time.monotonic() - started >= GRACE_S * 0.5
                time.sleep(0.5)
                assert served.controller.counts_claims["0001"].instance == worker.beats.instance
            assert client.heartbeat("0001", {"busy": False})["drain"] is False  # an SDK without instance: as before
            client.heartbeat("0001", {"rollouts": 1, "instance": "next", "step": "1.3"})  # the last one closed
            served.controller.state.workers["0001"].step_id = "4"  # relaunched: its new process is let in
            client.heartbeat("0001", {"rollouts": 0, "instance": "relaunched", "step": "1.4"})
    finally:
        served.close()


def test_the_refusal_comes_from_the_route_too(served: ServedController) -> None:
    """The heartbeat's fast path answers when the lock is free; with a tick holding it, the route."""
    try:
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"instance": "one", "step": "1.3"})
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
            with pytest.raises(DuplicateWorkerError) as refused:
                client.heartbeat("0001", {"instance": "two", "step": "1.3"})
            holder.join()
            assert 0 < refused.value.retry_after_s <= GRACE_S + 1 and refused.value.holder_beats == 2
            served.controller.state.workers["0001"].step_id = "4"
            with pytest.raises(DuplicateWorkerError) as old:
                client.heartbeat("0001", {"instance": "one", "step": "1.3"})
            assert old.value.retry_after_s == 0 and old.value.holder_beats is None
    finally:
        served.close()


def test_a_restarted_controller_refuses_a_process_of_an_earlier_step(served: ServedController, tmp_path: Path) -> None:
    """Claims are not saved, and the step check needs none: after a restart, a process of the
    worker's earlier launch that beats first is refused and the current step's process let in.
    Before, the straggler took the claim and the new launch's counts, and the new launch's own
    process was refused (its start() raised: a crash on its GPU)."""
    try:
        served.controller.state.workers["0001"].step_id = "4"  # the worker now runs as step 1.4
        served.controller.save()
        restarted = Controller(served.controller.config, 1, SlurmCli(timeout_s=5), tmp_path,
                               gpus_by_node={"node1": (0, 1)})
        with pytest.raises(DuplicateInstanceError) as refused:
            restarted.heartbeat("0001", {"rollouts": 40, "instance": "old", "step": "1.3"})
        assert "belongs to step 1.3, an earlier launch of worker 0001; the worker now runs as step 1.4" in str(
            refused.value) and refused.value.retry_after_s is None
        assert restarted.heartbeat("0001", {"rollouts": 2, "instance": "new", "step": "1.4"})["drain"] is False
        assert restarted.state.workers["0001"].rollouts == 2
    finally:
        served.close()


def test_a_process_of_the_earlier_launch_never_takes_the_new_launchs_counts(served: ServedController) -> None:
    """A worker crashed and was launched again while its old process still beats: that process is
    refused (409, no Retry-After: never let in) and its counts are not taken; the new launch's
    process is let in at once and keeps the counts."""
    try:
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"rollouts": 40, "instance": "old", "step": "1.3"})
            worker = served.controller.state.workers["0001"]
            worker.step_id = "4"  # crashed, launched again, and its new step registered
            with pytest.raises(DuplicateWorkerError) as refused:
                client.heartbeat("0001", {"rollouts": 41, "instance": "old", "step": "1.3"})
            assert refused.value.detail.startswith("duplicate worker 0001: this process belongs to step 1.3, an "
                                                   "earlier launch"), refused.value.detail
            assert refused.value.retry_after_s == 0 and refused.value.holder_beats is None
            assert worker.rollouts == 40  # not the old process's 41
            client.heartbeat("0001", {"rollouts": 0, "instance": "new", "step": "1.4"})
            assert served.controller.counts_claims["0001"].instance == "new" and worker.rollouts == 0
            claim = served.controller.counts_claims["0001"]
            served.controller.counts_claims["0001"] = replace(claim, heard_s=claim.heard_s - 10 * GRACE_S)
            with pytest.raises(DuplicateWorkerError):  # the new one silent past the grace: still not the old one
                client.heartbeat("0001", {"rollouts": 42, "instance": "old", "step": "1.3"})
            assert worker.rollouts == 0
    finally:
        served.close()


def test_a_step_adopted_again_goes_on_with_its_process(served: ServedController) -> None:
    """The record of a live step ended (its listing failed for a while) and the step was adopted
    again: the step's own SDK process beats on and admits (before: refused for good as a process
    of an earlier launch, its next admit raised and the process exited non-zero)."""
    try:
        with RolloutWorker.from_env() as worker:
            time.sleep(0.3)
            controller = served.controller
            with controller.lock:
                record = controller.state.workers["0001"]
                transition(record, WorkerState.FAILED, controller.clock(), "its step left the listing")
                record.step_id = ""
                _adopt_and_refresh(controller.state.workers, {"0001": ObservedStep("0001", "3", "node1", 1)},
                                   controller.clock(), Plan())
            time.sleep(0.6)
            assert worker.beats.refused is None and worker.admit(1, wait=False) == 1
            assert controller.counts_claims["0001"].instance == worker.beats.instance
    finally:
        served.close()


class Paused:
    """A pause watch that says how long the controller did not run."""

    def __init__(self) -> None:
        self.lost_s = 0.0

    def lost_total_s(self) -> float:
        return self.lost_s


def test_a_pause_of_the_controller_expires_no_live_holder(served: ServedController) -> None:
    """Nobody could beat while the controller stood still: the grace runs on a clock the pause does
    not move, so a holder heard just before the pause holds on (and before the tick has taken it)."""
    try:
        served.controller.pause_watch = Paused()  # type: ignore[assignment]
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"instance": "one", "step": "1.3"})
            claim = served.controller.counts_claims["0001"]
            served.controller.counts_claims["0001"] = replace(claim, heard_s=claim.heard_s - 5 * GRACE_S)
            served.controller.pause_watch.lost_s = 5 * GRACE_S  # type: ignore[union-attr]
            with pytest.raises(DuplicateWorkerError):
                client.heartbeat("0001", {"instance": "two", "step": "1.3"})
    finally:
        served.close()


def test_after_a_pause_the_successor_of_a_dead_process_is_let_in(served: ServedController) -> None:
    """The holder died, then the controller was paused: its claim was heard "recently" on the
    paused clock, but its beats never move, so start() waits out the grace and is let in. Before,
    start() read the moved heard time as a live process and raised."""
    try:
        served.controller.pause_watch = Paused()  # type: ignore[assignment]
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"rollouts": 5, "instance": "gone", "step": "1.3"})  # then killed
        served.controller.pause_watch.lost_s = 0.8 * GRACE_S  # type: ignore[union-attr]  # a pause since
        started = time.monotonic()
        with RolloutWorker.from_env() as worker:
            assert time.monotonic() - started >= GRACE_S * 0.5
            assert served.controller.counts_claims["0001"].instance == worker.beats.instance
    finally:
        served.close()


@pytest.fixture
def long_grace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServedController]:
    """A controller whose grace (30 s) is far longer than its workers' heartbeat interval (0.2 s)."""
    server = ServedController(tmp_path, TOKEN, {**CONFIG, "workers": {"heartbeat_interval_s": 0.2,
                                                                       "heartbeat_grace_s": 30}}).launched("0001")
    server.controller.register_worker("0001", {"node": "node1", "gpus": [0], "step_id": "3"})
    for name, value in {"SLURM_ELASTIC_WORKER_ID": "0001", "SLURM_ELASTIC_CONTROLLER_URL": server.url,
                        "SLURM_ELASTIC_TOKEN": TOKEN, "SLURM_ELASTIC_HEARTBEAT_INTERVAL_S": "0.2", "SLURM_JOB_ID": "1",
                        "SLURM_STEP_ID": "3"}.items():
        monkeypatch.setenv(name, value)
    previous = signal.getsignal(signal.SIGUSR1)
    yield server
    signal.signal(signal.SIGUSR1, previous)
    server.close()


def test_a_live_duplicate_is_refused_after_one_heartbeat_interval_not_the_grace(long_grace: ServedController) -> None:
    """The second ask, a heartbeat interval + 0.5 s later, sees the first process's beat count moved:
    it is live, and start() raises then (not after the whole grace). The handler before start() is
    back, and its line to the controller closed (before: both stayed)."""
    with RolloutWorker.from_env():
        first_handler = signal.getsignal(signal.SIGUSR1)
        second = RolloutWorker.from_env()
        started = time.monotonic()
        with pytest.raises(DuplicateWorkerError) as refused:
            second.start()
        assert time.monotonic() - started < 5 and refused.value.retry_after_s > 25
        assert refused.value.holder_beats is not None and refused.value.holder_beats > 1
        assert signal.getsignal(signal.SIGUSR1) is first_handler
        with pytest.raises(RuntimeError, match="after close"):
            second.admit(1)
        assert second.control.client._http.is_closed  # type: ignore[attr-defined]


def test_a_drain_while_start_waits_only_sets_the_flag(long_grace: ServedController) -> None:
    """A predecessor that died without closing: start() waits for its claim to go, and a drain (the
    drain signal, a burst job's end) during that wait ends it: the worker is draining and reports
    nothing. Before: the handler was installed after the wait, and the signal killed the process."""
    with ControlClient(long_grace.url, TOKEN) as client:
        client.heartbeat("0001", {"rollouts": 5, "instance": "gone", "step": "1.3"})  # then killed: no closing beat
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    def drain_once_installed() -> None:  # the drain signal, once start() installed its handler
        deadline = time.monotonic() + 10
        while signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # start() waits by now: its first ask was refused
        os.kill(os.getpid(), signal.SIGUSR1)

    threading.Thread(target=drain_once_installed, daemon=True).start()
    started = time.monotonic()
    with RolloutWorker.from_env() as worker:
        assert worker.draining and time.monotonic() - started < 5
        assert worker.admit(1) == 0 and not worker.beats.thread.is_alive()
    assert long_grace.controller.counts_claims["0001"].instance == "gone"


def test_an_admit_waiting_hears_the_refusal_and_raises_it(served: ServedController) -> None:
    """The worker's step was launched again (its record names the new step): the old step's
    process's heartbeats are refused, and its admit that waits raises that refusal (before: it
    waited on, the refusal only checked when a call began); submit raises it too, not read as a
    refused group (DuplicateWorkerError is no ApiError)."""
    try:
        with RolloutWorker.from_env() as worker:
            outcome: list[BaseException | int] = []

            def ask() -> None:
                try:
                    outcome.append(worker.admit(41, poll_s=0.05))  # more than may run at once: it waits
                except BaseException as exc:
                    outcome.append(exc)

            asking = threading.Thread(target=ask, daemon=True)
            asking.start()
            time.sleep(0.3)
            served.controller.state.workers["0001"].step_id = "4"
            asking.join(timeout=10)
            assert len(outcome) == 1 and isinstance(outcome[0], DuplicateWorkerError), outcome
            assert not isinstance(outcome[0], ApiError)
            with pytest.raises(DuplicateWorkerError):
                worker.submit({"id": "g1", "policy_version": 0, "group_size": 1,
                               "sequences": [{"tokens": [1], "mask": [1], "score": 1.0}]})
    finally:
        served.close()
