"""A worker SDK or trainer helper whose token the controller refuses (401, 403): a wrong token,
or another job's controller at the address. Before, the SDK's submit tried again for ever,
logging the 403 once a minute, and the trainer raised a bare ``HTTP 403`` at its first call (also
for another job's controller briefly on a restarted controller's old port). Now both read the
controller's address again on each refusal and, after a few tries over
``TOKEN_REFUSED_WAIT_S``, raise :class:`TokenRefusedError` naming where the token came from;
errors that pass (no connection, 503) are still waited through."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from slurm_elastic.client import refusals
from slurm_elastic.controller.files import publish
from slurm_elastic.errors import ApiError, TokenRefusedError
from slurm_elastic.trainer import Trainer
from slurm_elastic.worker import RolloutWorker
from tests.unit.served_controller import ServedController
from tests.unit.test_client_hostile_server import Hostile, url

TOKEN = "the-jobs-token"
GROUP = {"id": "g1", "policy_version": 0, "group_size": 1, "sequences": [{"tokens": [1, 2], "score": 1.0}]}


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServedController]:
    monkeypatch.setattr(refusals, "TOKEN_REFUSED_WAIT_S", 1.0)
    controller = ServedController(tmp_path, TOKEN, {"autoscaler": {"min_workers": 0}}, batch_size=1).launched("0001")
    publish(tmp_path, controller.url, 1)
    yield controller
    controller.close()


def worker_env(monkeypatch: pytest.MonkeyPatch, served: ServedController, state_dir: Path) -> None:
    for name, value in {"SLURM_ELASTIC_WORKER_ID": "0001", "SLURM_ELASTIC_CONTROLLER_URL": served.url,
                        "SLURM_ELASTIC_STATE_DIR": str(state_dir), "SLURM_ELASTIC_HEARTBEAT_INTERVAL_S": "0.2"}.items():
        monkeypatch.setenv(name, value)


def test_a_worker_with_another_jobs_token_file_fails_naming_it(
        served: ServedController, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = tmp_path / "other-job" / "token"
    token_file.parent.mkdir()
    token_file.write_text("another-jobs-token\n")
    worker_env(monkeypatch, served, tmp_path)
    monkeypatch.setenv("SLURM_ELASTIC_TOKEN_FILE", str(token_file))
    started = time.monotonic()
    with RolloutWorker.from_env() as worker:
        with pytest.raises(TokenRefusedError) as caught:
            worker.submit(GROUP)
        took_s = time.monotonic() - started
        with pytest.raises(TokenRefusedError):
            worker.admit(1)
    assert caught.value.status_code == 403 and f"SLURM_ELASTIC_TOKEN_FILE ({token_file})" in str(caught.value)
    assert 1.0 <= took_s < 10  # a few tries over TOKEN_REFUSED_WAIT_S, not for ever
    assert served.queue.stats()["queued_groups"] == 0
    with served.controller.lock:
        assert served.controller.status()["heartbeats"] == 0  # every call of the worker's was refused


def test_a_worker_given_a_wrong_token_variable_fails_naming_it(
        served: ServedController, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker_env(monkeypatch, served, tmp_path)
    monkeypatch.setenv("SLURM_ELASTIC_TOKEN", "not-the-token")
    with RolloutWorker.from_env() as worker, pytest.raises(TokenRefusedError, match="from SLURM_ELASTIC_TOKEN:"):
        worker.give_back(1)


def test_the_right_token_still_submits(served: ServedController, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    worker_env(monkeypatch, served, tmp_path)
    monkeypatch.setenv("SLURM_ELASTIC_TOKEN", TOKEN)
    with RolloutWorker.from_env() as worker:
        assert worker.admit(1) == 1
        assert worker.submit(GROUP)["accepted"] is True
    assert served.queue.stats()["queued_groups"] == 1


def test_a_trainer_with_a_wrong_token_file_fails_naming_it(
        served: ServedController, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "token").write_text("a-token-made-anew\n")  # not the one the controller holds
    monkeypatch.setenv("SLURM_ELASTIC_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("SLURM_ELASTIC_TOKEN", raising=False)
    monkeypatch.delenv("SLURM_ELASTIC_TOKEN_FILE", raising=False)
    started = time.monotonic()
    with pytest.raises(TokenRefusedError) as caught:
        Trainer.from_env()
    assert f"the job's token file {tmp_path / 'token'}" in str(caught.value)
    assert isinstance(caught.value, ApiError) and 1.0 <= time.monotonic() - started < 10


def test_a_trainer_follows_controller_json_past_another_jobs_controller(
        served: ServedController, tmp_path: Path) -> None:
    """Another job's controller answers 403 on the old port until ``controller.json`` names the
    restarted one: the trainer registers there. Before, its registration raised the 403 at once."""
    other = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    other.daemon_threads = True
    other.mode, other.calls = "forbidden", 0  # type: ignore[attr-defined]
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        publish(tmp_path, url(other), 1)
        threading.Timer(0.5, publish, (tmp_path, served.url, 1)).start()
        trainer = Trainer(url(other), TOKEN, state_dir=tmp_path, poll_s=0.05)
        try:
            assert trainer.client.url == served.url and trainer.session is not None
            assert other.calls >= 1  # type: ignore[attr-defined]
        finally:
            trainer.close()
    finally:
        other.shutdown()
        other.server_close()


def test_a_router_with_a_wrong_token_says_so(served: ServedController, caplog: pytest.LogCaptureFixture) -> None:
    """Before, discovery logged each 403 at DEBUG and ``wait_for_endpoints`` said only
    ``0 routable servers after 1 s``."""
    from slurm_elastic.router import Router, RoutingError

    router = Router(served.url, "not-the-token", poll_wait_s=0.1)
    try:
        with pytest.raises(RoutingError, match="could not be asked: HTTP 403: wrong token for this job"):
            router.wait_for_endpoints(1, timeout_s=1.0)
        assert "refuses the router's token" in caplog.text
    finally:
        router.close()
