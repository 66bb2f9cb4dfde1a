"""Two SDK processes under one worker id: the controller tells them apart by the instance each
sends with its counts and refuses the second live one (409, Retry-After), which ``start()`` raises
as :class:`DuplicateWorkerError`. Before, both were one worker to the controller: its rollout count
and busy time took turns between them. A process that closed, one silent past the heartbeat grace,
a relaunched worker, a restarted controller and an SDK that sends no instance are all let in."""

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
from slurm_elastic.controller.files import publish
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.registration import CountsClaim, claim_refusal, next_claim
from slurm_elastic.errors import ApiError, DuplicateWorkerError
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.worker import RolloutWorker
from tests.unit.served_controller import ServedController

TOKEN = "duplicate-token"
GRACE_S = 1.0
CONFIG = {"autoscaler": {"min_workers": 0}, "workers": {"heartbeat_interval_s": 0.2, "heartbeat_grace_s": GRACE_S}}


def test_the_rule() -> None:
    claim = CountsClaim("a", heard_s=100.0, launch=1)
    assert claim_refusal("0001", None, "a", 1, 100.0, 60.0) == ""  # nothing claimed yet
    assert claim_refusal("0001", claim, "a", 1, 101.0, 60.0) == ""  # its own beat
    said = claim_refusal("0001", claim, "b", 1, 130.0, 60.0)
    assert said.startswith("duplicate worker 0001: another process already reports for this worker id (heard 30 s "
                           "ago); two RolloutWorkers under one id would mix their rollout counts and busy time"), said
    assert claim_refusal("0001", claim, "b", 1, 160.0, 60.0) == ""  # silent for the grace: taken as gone
    assert claim_refusal("0001", claim, "b", 2, 130.0, 60.0) == ""  # a relaunch: a new process
    # the earlier launch's process beats on after the relaunch: refused, whatever the new one does
    old = claim_refusal("0001", claim, "a", 2, 101.0, 60.0)
    assert old.startswith("duplicate worker 0001: this process reported for an earlier launch of this worker id, "
                          "and the controller launched it again since"), old
    taken = next_claim(claim, "b", 2, 130.0)
    assert taken == CountsClaim("b", 130.0, 2, earlier=("a",))
    assert claim_refusal("0001", taken, "a", 2, 1000.0, 60.0) == old  # even with the new one silent
    closed = next_claim(taken, "b", 2, 140.0, closing=True)
    assert closed.instance == "" and claim_refusal("0001", closed, "c", 2, 141.0, 60.0) == ""
    assert claim_refusal("0001", closed, "a", 2, 141.0, 60.0) == old


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ServedController:
    server = ServedController(tmp_path, TOKEN, CONFIG).launched("0001")
    publish(tmp_path, server.url, 1)
    server.controller.register_worker("0001", {"node": "node1", "gpus": [0], "step_id": "3"})
    for name, value in {"SLURM_ELASTIC_WORKER_ID": "0001", "SLURM_ELASTIC_CONTROLLER_URL": server.url,
                        "SLURM_ELASTIC_TOKEN": TOKEN, "SLURM_ELASTIC_STATE_DIR": str(tmp_path),
                        "SLURM_ELASTIC_HEARTBEAT_INTERVAL_S": "0.2"}.items():
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
            assert after.instance != first.instance
    finally:
        served.close()


def test_a_process_that_died_without_closing_is_replaced_after_the_grace(served: ServedController) -> None:
    try:
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"rollouts": 5, "instance": "gone"})  # then killed: no closing beat
            started = time.monotonic()
            with RolloutWorker.from_env() as worker:  # refused once, then let in after the Retry-After
                assert time.monotonic() - started >= GRACE_S * 0.5
                time.sleep(0.5)
                assert served.controller.counts_claims["0001"].instance == worker.instance
            assert client.heartbeat("0001", {"busy": False})["drain"] is False  # an SDK without instance: as before
            client.heartbeat("0001", {"rollouts": 1, "instance": "next"})  # the last one closed: let in
            served.controller.state.workers["0001"].launches += 1  # relaunched: its new process is let in
            client.heartbeat("0001", {"rollouts": 0, "instance": "relaunched"})
    finally:
        served.close()


def test_the_refusal_comes_from_the_route_too_and_a_restarted_controller_lets_in_the_first(
        served: ServedController, tmp_path: Path) -> None:
    """The heartbeat's fast path answers when the lock is free; with a tick holding it, the route."""
    try:
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"instance": "one"})
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
                client.heartbeat("0001", {"instance": "two"})
            holder.join()
            assert 0 < refused.value.retry_after_s <= GRACE_S + 1
        served.controller.save()
        restarted = Controller(served.controller.config, 1, SlurmCli(timeout_s=5), tmp_path,
                               gpus_by_node={"node1": (0, 1)})
        assert restarted.heartbeat("0001", {"instance": "two"})["drain"] is False  # claims are not saved
    finally:
        served.close()


def test_a_process_of_the_earlier_launch_never_takes_the_new_launchs_counts(served: ServedController) -> None:
    """A worker crashed and was launched again while its old process still beats: that process is
    refused (409, no Retry-After: never let in) and its counts are not taken; the new launch's
    process is let in at once and keeps the counts. Before: the old process's beat moved its claim
    to the new launch, its counts went into the new launch's record, and the new step's own
    process got 409 (its start() raised, the command exited non-zero: a crash on its GPU)."""
    try:
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"rollouts": 40, "instance": "old"})
            worker = served.controller.state.workers["0001"]
            worker.launches += 1  # crashed and launched again (_launch counts it)
            worker.launched_at_s += 1
            with pytest.raises(DuplicateWorkerError) as refused:
                client.heartbeat("0001", {"rollouts": 41, "instance": "old"})
            assert refused.value.detail.startswith("duplicate worker 0001: this process reported for an earlier "
                                                   "launch"), refused.value.detail
            assert refused.value.retry_after_s == 0 and refused.value.heard_ago_s is None
            assert worker.rollouts == 40  # not the old process's 41
            client.heartbeat("0001", {"rollouts": 0, "instance": "new"})
            assert served.controller.counts_claims["0001"].instance == "new" and worker.rollouts == 0
            claim = served.controller.counts_claims["0001"]
            served.controller.counts_claims["0001"] = replace(claim, heard_s=claim.heard_s - 10 * GRACE_S)
            with pytest.raises(DuplicateWorkerError):  # the new one silent past the grace: still not the old one
                client.heartbeat("0001", {"rollouts": 42, "instance": "old"})
            assert worker.rollouts == 0
    finally:
        served.close()


def test_a_start_clock_moved_on_is_no_relaunch(served: ServedController) -> None:
    """A STARTING worker's start clock moves at a pause and a controller restart without a new
    process: a second live one is still refused (before: the claim was tied to that clock)."""
    try:
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"instance": "one"})
            served.controller.state.workers["0001"].launched_at_s += 30
            with pytest.raises(DuplicateWorkerError):
                client.heartbeat("0001", {"instance": "two"})
    finally:
        served.close()


def test_a_pause_of_the_controller_moves_the_claims_on(served: ServedController) -> None:
    """Nobody could beat while the controller stood still: a claim heard before the pause holds on
    (before: it expired in the pause, and a second process was let in at the resume)."""
    try:
        with ControlClient(served.url, TOKEN) as client:
            client.heartbeat("0001", {"instance": "one"})
            claim = served.controller.counts_claims["0001"]
            served.controller.counts_claims["0001"] = replace(claim, heard_s=claim.heard_s - 5 * GRACE_S)
            with served.controller.lock:
                served.controller.move_busy_clocks_on(5 * GRACE_S)  # what the tick does after a pause
            with pytest.raises(DuplicateWorkerError):
                client.heartbeat("0001", {"instance": "two"})
    finally:
        served.close()


@pytest.fixture
def long_grace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServedController]:
    """A controller whose grace (30 s) is far longer than its workers' heartbeat interval (0.2 s)."""
    server = ServedController(tmp_path, TOKEN, {**CONFIG, "workers": {"heartbeat_interval_s": 0.2,
                                                                       "heartbeat_grace_s": 30}}).launched("0001")
    server.controller.register_worker("0001", {"node": "node1", "gpus": [0], "step_id": "3"})
    for name, value in {"SLURM_ELASTIC_WORKER_ID": "0001", "SLURM_ELASTIC_CONTROLLER_URL": server.url,
                        "SLURM_ELASTIC_TOKEN": TOKEN, "SLURM_ELASTIC_HEARTBEAT_INTERVAL_S": "0.2"}.items():
        monkeypatch.setenv(name, value)
    previous = signal.getsignal(signal.SIGUSR1)
    yield server
    signal.signal(signal.SIGUSR1, previous)
    server.close()


def test_a_live_duplicate_is_refused_after_one_heartbeat_interval_not_the_grace(long_grace: ServedController) -> None:
    """The second ask, a heartbeat interval later, hears the first process beat since: it is live,
    and start() raises then (before: it waited out the whole grace). The handler before start() is
    back, and its line to the controller closed (before: both stayed)."""
    with RolloutWorker.from_env():
        first_handler = signal.getsignal(signal.SIGUSR1)
        second = RolloutWorker.from_env()
        started = time.monotonic()
        with pytest.raises(DuplicateWorkerError) as refused:
            second.start()
        assert time.monotonic() - started < 5 and refused.value.retry_after_s > 25
        assert refused.value.heard_ago_s is not None and refused.value.heard_ago_s < 0.7
        assert signal.getsignal(signal.SIGUSR1) is first_handler
        with pytest.raises(RuntimeError, match="after close"):
            second.admit(1)
        assert second.control.client._http.is_closed  # type: ignore[attr-defined]


def test_a_drain_while_start_waits_only_sets_the_flag(long_grace: ServedController) -> None:
    """A predecessor that died without closing: start() waits for its claim to go, and a drain (the
    drain signal, a burst job's end) during that wait ends it: the worker is draining and reports
    nothing. Before: the handler was installed after the wait, and the signal killed the process."""
    with ControlClient(long_grace.url, TOKEN) as client:
        client.heartbeat("0001", {"rollouts": 5, "instance": "gone"})  # then killed: no closing beat
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
        assert worker.admit(1) == 0 and not worker._thread.is_alive()
    assert long_grace.controller.counts_claims["0001"].instance == "gone"


def test_an_admit_waiting_hears_the_refusal_and_raises_it(served: ServedController) -> None:
    """The worker's step was launched again and the new launch's process holds the counts: the old
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
            served.controller.state.workers["0001"].launches += 1
            with ControlClient(served.url, TOKEN) as client:
                client.heartbeat("0001", {"instance": "new"})
            asking.join(timeout=10)
            assert len(outcome) == 1 and isinstance(outcome[0], DuplicateWorkerError), outcome
            assert not isinstance(outcome[0], ApiError)
            with pytest.raises(DuplicateWorkerError):
                worker.submit({"id": "g1", "policy_version": 0, "group_size": 1,
                               "sequences": [{"tokens": [1], "mask": [1], "score": 1.0}]})
    finally:
        served.close()
