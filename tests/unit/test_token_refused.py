"""A worker SDK or trainer helper whose token the controller refuses (401, 403): a wrong token,
or another job's controller on the old address while this job's controller restarts (for the
whole restart: until ``controller.json`` names the new one). Both read the controller's address
again on each refusal. A submit never gives up its group (the refusal is logged once a minute,
naming the token's source); a call that holds no data raises :class:`TokenRefusedError` naming
where the token came from once the refusals in a row have gone on for ``TOKEN_REFUSED_WAIT_S``
(a restart's scale; shortened here), unless the caller's deadline or a drain ends its wait first."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from slurm_elastic.client import refusals
from slurm_elastic.client.control import ControlClient
from slurm_elastic.client.locate import controller_from_env
from slurm_elastic.controller.files import mark_stopped_by_operator, publish
from slurm_elastic.errors import (
    ApiError,
    ControllerStoppedError,
    ControllerUnreachableError,
    TokenRefusedError,
)
from slurm_elastic.trainer import Trainer
from slurm_elastic.worker import RolloutWorker
from slurm_elastic.worker.context import StepContext
from slurm_elastic.worker.wrapper import Flags, register_with_retry
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
        served: ServedController, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    token_file = tmp_path / "other-job" / "token"
    token_file.parent.mkdir()
    token_file.write_text("another-jobs-token\n")
    worker_env(monkeypatch, served, tmp_path)
    monkeypatch.setenv("SLURM_ELASTIC_TOKEN_FILE", str(token_file))
    with caplog.at_level(logging.WARNING), RolloutWorker.from_env() as worker:
        started = time.monotonic()
        with pytest.raises(TokenRefusedError) as caught:
            worker.admit(1)
        took_s = time.monotonic() - started
    assert "heartbeat: the controller at" in caplog.text  # the heartbeats say so too, and never raise
    assert caught.value.status_code == 403 and f"SLURM_ELASTIC_TOKEN_FILE ({token_file})" in str(caught.value)
    assert "or a controller restart in progress" in str(caught.value)
    assert 1.0 <= took_s < 10  # the refusals' window (shortened here), not for ever
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

    router = Router(served.url, "not-the-token", poll_wait_s=0.1, token_source="SLURM_ELASTIC_TOKEN")
    try:
        with pytest.raises(RoutingError, match="the last poll of the endpoints failed: HTTP 403: wrong token"):
            router.wait_for_endpoints(1, timeout_s=1.0)
        assert "refuses the router's token" in caplog.text and "the token is from SLURM_ELASTIC_TOKEN" in caplog.text
        assert "while this job's restarts" in caplog.text
    finally:
        router.close()


def forbidden_server() -> ThreadingHTTPServer:
    """Another job's controller: 403 to every call."""
    other = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    other.daemon_threads = True
    other.mode, other.calls = "forbidden", 0  # type: ignore[attr-defined]
    threading.Thread(target=other.serve_forever, daemon=True).start()
    return other


def test_a_submit_waits_out_a_restart_longer_than_the_refusals_window(
        served: ServedController, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Our controller restarts and another job's holds its old address (403) until
    ``controller.json`` names the new one, longer than the refusals' window (1 s here). Before,
    the submit raised TokenRefusedError after the window and the worker lost its group."""
    other = forbidden_server()
    try:
        worker_env(monkeypatch, served, tmp_path)
        monkeypatch.setenv("SLURM_ELASTIC_CONTROLLER_URL", url(other))
        monkeypatch.setenv("SLURM_ELASTIC_TOKEN", TOKEN)
        publish(tmp_path, url(other), 1)
        with caplog.at_level(logging.WARNING), RolloutWorker.from_env() as worker:
            threading.Timer(2.5, publish, (tmp_path, served.url, 1)).start()
            started = time.monotonic()
            answer = worker.submit(GROUP)
        assert answer["accepted"] is True and time.monotonic() - started >= 2.0
        assert served.queue.stats()["queued_groups"] == 1 and other.calls >= 3  # type: ignore[attr-defined]
        assert "the token is from SLURM_ELASTIC_TOKEN): a wrong token, or another job's controller on the old " \
               "address while this job's controller restarts" in caplog.text
    finally:
        other.shutdown()
        other.server_close()


def test_the_refusals_window_counts_refusals_in_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """One refusal, then the controller unreachable (a restart), then refusals: the window starts
    again at the first refusal after the outage. Before, it counted from the first refusal, so the
    error came after a refusal or two past the outage."""
    monkeypatch.setattr(refusals, "TOKEN_REFUSED_WAIT_S", 1.0)
    ctx = StepContext.from_env({"SLURM_ELASTIC_WORKER_ID": "0001", "SLURM_ELASTIC_CONTROLLER_URL": "http://old:1",
                                "SLURM_ELASTIC_TOKEN": "t"})
    control = mock.Mock()
    control.refresh.return_value = False
    control.client.url = "http://old:1"
    worker = RolloutWorker(ctx, control=control)
    tries: list[str] = []

    def call() -> dict[str, Any]:
        tries.append("unreachable" if tries in (["403"], ["403", "unreachable"]) else "403")
        if tries[-1] == "403":
            raise ApiError(403, "wrong token for this job")
        raise ControllerUnreachableError("down", not_connected=True)

    with pytest.raises(TokenRefusedError, match="on 3 tries in a row"):
        worker._through_outages(call, give_up_on_drain=False)
    assert tries == ["403", "unreachable", "unreachable", "403", "403", "403"]


def test_token_refusals_reset_and_window() -> None:
    now = [0.0]
    counted = refusals.TokenRefusals("SLURM_ELASTIC_TOKEN", clock=lambda: now[0], wait_s=10.0)
    assert not counted.count() and not counted.count()
    now[0] = 11.0
    counted.reset()
    assert not counted.count() and not counted.count()  # the run starts again at 11 s
    now[0] = 21.0
    assert counted.count()


def test_a_trainer_call_refused_ends_at_its_timeout(served: ServedController, monkeypatch: pytest.MonkeyPatch) -> None:
    """``next_batch(timeout_s=0.5)`` at an address that refuses the token returns None at its
    deadline, as for an unreachable controller. Before, it went on for the whole window."""
    monkeypatch.setattr(refusals, "TOKEN_REFUSED_WAIT_S", 30.0)
    trainer = Trainer(served.url, TOKEN, poll_s=0.05)
    try:
        trainer._line.client = ControlClient(served.url, "not-the-token")  # the address now refuses the token
        started = time.monotonic()
        assert trainer.next_batch(timeout_s=0.5) is None
        assert time.monotonic() - started < 3
    finally:
        trainer.close()


def test_a_drain_ends_a_wait_on_a_refused_token(served: ServedController, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiting admit at an address that refuses the token returns once a drain comes, as while
    the controller is unreachable. Before, it waited for the whole window."""
    monkeypatch.setattr(refusals, "TOKEN_REFUSED_WAIT_S", 30.0)
    worker_env(monkeypatch, served, tmp_path)
    monkeypatch.setenv("SLURM_ELASTIC_TOKEN", "not-the-token")
    granted: list[int] = []
    with RolloutWorker.from_env() as worker:
        waiting = threading.Thread(target=lambda: granted.append(worker.admit(1)))
        waiting.start()
        time.sleep(0.5)
        worker.request_drain()
        waiting.join(timeout=5)
    assert granted == [0]


def test_a_step_registration_waits_out_another_jobs_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step wrapper's registration refused (403) is asked again, as through a restart; before,
    the step exited 1 at the first refusal."""
    monkeypatch.setattr(refusals, "TOKEN_REFUSED_WAIT_S", 30.0)
    answers: list[Any] = [ApiError(403, "wrong token for this job"), ApiError(403, "wrong token for this job"),
                          {"action": "run"}]

    def register(_info: dict[str, Any]) -> dict[str, Any]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return dict(answer)

    assert register_with_retry(register, {}, time.monotonic() + 60, Flags()) == {"action": "run"}


def test_the_token_source_names_the_copy_read(tmp_path: Path) -> None:
    """A token file missing, its copy read: the source says so (before: the missing file)."""
    (tmp_path / ".token.copy").write_text("from-the-copy\n")
    token_file = tmp_path / "token"
    ctx = StepContext.from_env({"SLURM_ELASTIC_WORKER_ID": "0001", "SLURM_ELASTIC_CONTROLLER_URL": "http://c:1",
                                "SLURM_ELASTIC_TOKEN_FILE": str(token_file)})
    assert ctx.token == "from-the-copy"
    assert ctx.token_source.startswith(f"{tmp_path / '.token.copy'} (the copy beside SLURM_ELASTIC_TOKEN_FILE")
    where = controller_from_env({"SLURM_ELASTIC_STATE_DIR": str(tmp_path), "SLURM_ELASTIC_CONTROLLER_URL": "http://c:1"})
    assert where.token_source.startswith(f"{tmp_path / '.token.copy'} (the copy beside the job's token file")


def test_short_next_batch_calls_count_their_refusals_together(served: ServedController) -> None:
    """A trainer loop of short ``next_batch`` calls at an address that refuses its token gets
    TokenRefusedError once the refusals in a row have gone on for the window (1 s here), as one
    long call does. Before, each call counted its own refusals from zero: None for ever."""
    trainer = Trainer(served.url, TOKEN, poll_s=0.05)
    try:
        trainer._line.client = ControlClient(served.url, "not-the-token")
        started = time.monotonic()
        with pytest.raises(TokenRefusedError, match="in a row"):
            while time.monotonic() - started < 10:
                assert trainer.next_batch(timeout_s=0.2) is None
        assert 1.0 <= time.monotonic() - started < 10
    finally:
        trainer.close()


def test_a_trainer_refused_after_its_controller_was_stopped_hears_that_it_stopped(
        served: ServedController, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's controller was stopped (``slurm-elastic stop``) and another job's controller took
    its port: the refusal reads the stop mark, and the trainer gets ControllerStoppedError at once.
    Before, a refusal was asked again before the mark was read: TokenRefusedError after the window."""
    monkeypatch.setattr(refusals, "TOKEN_REFUSED_WAIT_S", 30.0)
    trainer = Trainer(served.url, TOKEN, tmp_path, poll_s=0.05)
    try:
        trainer._line.client = ControlClient(served.url, "not-the-token")  # another job's controller, say
        mark_stopped_by_operator(tmp_path)
        started = time.monotonic()
        with pytest.raises(ControllerStoppedError, match="slurm-elastic stop"):
            trainer.next_batch(timeout_s=20)
        assert time.monotonic() - started < 3
    finally:
        trainer.close()
