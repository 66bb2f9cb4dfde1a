"""Two SDK processes under one worker id: the controller tells them apart by the instance each
sends with its counts and refuses the second live one (409, Retry-After), which ``start()`` raises
as :class:`DuplicateWorkerError`. Before, both were one worker to the controller: its rollout count
and busy time took turns between them. A process that closed, one silent past the heartbeat grace,
a relaunched worker, a restarted controller and an SDK that sends no instance are all let in."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from slurm_elastic.client.control import ControlClient
from slurm_elastic.controller.files import publish
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.registration import CountsClaim, claim_refusal
from slurm_elastic.errors import DuplicateWorkerError
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.worker import RolloutWorker
from tests.unit.served_controller import ServedController

TOKEN = "duplicate-token"
GRACE_S = 1.0
CONFIG = {"autoscaler": {"min_workers": 0}, "workers": {"heartbeat_interval_s": 0.2, "heartbeat_grace_s": GRACE_S}}


def test_the_rule() -> None:
    claim = CountsClaim("a", heard_s=100.0, launched_at_s=50.0)
    assert claim_refusal("0001", None, "a", 50.0, 100.0, 60.0) == ""  # nothing claimed yet
    assert claim_refusal("0001", claim, "a", 50.0, 101.0, 60.0) == ""  # its own beat
    said = claim_refusal("0001", claim, "b", 50.0, 130.0, 60.0)
    assert said.startswith("duplicate worker 0001: another process already reports for this worker id (heard 30 s "
                           "ago); two RolloutWorkers under one id would mix their rollout counts and busy time"), said
    assert claim_refusal("0001", claim, "b", 50.0, 160.0, 60.0) == ""  # silent for the grace: taken as gone
    assert claim_refusal("0001", claim, "b", 120.0, 130.0, 60.0) == ""  # a relaunch: a new process


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
            served.controller.state.workers["0001"].launched_at_s += 1  # relaunched: its new process is let in
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
