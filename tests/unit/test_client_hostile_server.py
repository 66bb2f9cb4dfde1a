"""The SDK, the trainer helper and the router as clients of a broken or foreign server at the
controller's address (another process took its old port, a proxy's error page): an answer that
is not a JSON object, a redirect, a body without end or one dripped a byte at a time is a
:class:`ControllerAnswerError` (a :class:`ControllerUnreachableError`), within the call's
timeout; a worker keeps its group and a trainer its pull until ``controller.json`` names the
controller, and a router's report thread lives on."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from slurm_elastic.client import answers, control
from slurm_elastic.client.control import ControlClient
from slurm_elastic.controller.files import publish
from slurm_elastic.errors import ApiError, ControllerAnswerError, ControllerUnreachableError
from slurm_elastic.router import Router
from slurm_elastic.trainer import Trainer
from slurm_elastic.worker import RolloutWorker
from tests.unit.served_controller import ServedController

TOKEN = "hostile-server-token"


class Hostile(BaseHTTPRequestHandler):
    """Answers every request as ``self.server.mode`` says."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *_args: object) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        mode = self.server.mode  # type: ignore[attr-defined]
        self.server.calls += 1  # type: ignore[attr-defined]
        if mode == "drip":  # a head, then a byte every 0.2 s, each well within the read timeout
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            for _ in range(200):
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.2)
            return
        if mode == "not-http":  # another protocol's greeting on the controller's old port
            self.wfile.write(b"SSH-2.0-OpenSSH_9.6\r\n")
            self.close_connection = True
            return
        if mode == "endless":  # no Content-Length: the body ends when the connection does
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("connection", "close")
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b" " * 65536)
            except OSError:
                return
        code, body, extra = {
            "html": (200, b"<html><body>It works!</body></html>", {"content-type": "text/html"}),
            "list": (200, b'["accepted"]', {"content-type": "application/json"}),
            "forbidden": (403, b'{"detail": "wrong token for this job"}', {"content-type": "application/json"}),
            "not-found": (404, b'{"detail": "Not Found"}', {"content-type": "application/json"}),
            "gzip": (200, b'{"accepted": true}', {"content-type": "application/json", "content-encoding": "gzip"}),
            "redirect": (307, b'{"accepted": true}', {"location": "http://192.0.2.1/rollouts",
                                                       "content-type": "application/json"}),
        }[mode]
        self.send_response(code)
        for name, value in {**extra, "content-length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer


@pytest.fixture
def hostile() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    server.daemon_threads = True
    server.mode, server.calls = "html", 0  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize(("mode", "says"), [
    ("html", "not a JSON object: '<html>"), ("list", "not a JSON object"), ("redirect", "307"),
    ("drip", "still sending its answer"), ("endless", "more than 1048576 bytes"), ("gzip", "cannot be decoded")])
def test_an_answer_no_controller_gives_is_a_clear_error_within_the_timeout(
        hostile: ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch, mode: str, says: str) -> None:
    monkeypatch.setattr(control, "ANSWER_MAX_BYTES", 1 << 20)
    hostile.mode = mode  # type: ignore[attr-defined]
    started = time.monotonic()
    with ControlClient(url(hostile), TOKEN, timeout_s=1.0) as client, pytest.raises(ControllerAnswerError) as caught:
        client.status()
    assert says in str(caught.value) and isinstance(caught.value, ControllerUnreachableError)
    assert time.monotonic() - started < 5  # before: the drip held the call 40 s, the endless body until memory ran out


@pytest.mark.parametrize(("mode", "says"), [
    ("html", "not a JSON object: '<html>"), ("list", "not a JSON object"), ("redirect", "307"),
    ("drip", "still sending its answer"), ("endless", "more than 1048576 bytes"), ("not-http", "BadStatusLine")])
def test_the_step_wrappers_client_gives_the_same_clear_error_within_the_timeout(
        hostile: ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch, mode: str, says: str) -> None:
    """Its ``http.client`` read answers whole with no size limit and only a per-read timeout: a
    body without end grew the wrapper until memory ran out, a drip held a heartbeat 40 s."""
    from slurm_elastic.client.step_calls import StepControlClient

    monkeypatch.setattr(answers, "ANSWER_MAX_BYTES", 1 << 20)
    hostile.mode = mode  # type: ignore[attr-defined]
    client = StepControlClient(url(hostile), TOKEN, timeout_s=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(ControllerAnswerError) as caught:
            client.heartbeat("0001", {})
        assert says in str(caught.value) and isinstance(caught.value, ControllerUnreachableError)
        assert time.monotonic() - started < 5
    finally:
        client.close()


@pytest.mark.parametrize("mode", ["redirect", "list", "html", "gzip"])
def test_a_submit_answered_so_is_not_taken_as_stored(hostile: ThreadingHTTPServer, mode: str) -> None:
    """A 307 whose body says ``{"accepted": true}`` was returned as the submit's answer: the group
    counted as handed over, and was never stored."""
    hostile.mode = mode  # type: ignore[attr-defined]
    with ControlClient(url(hostile), TOKEN, timeout_s=1.0) as client, pytest.raises(ControllerAnswerError):
        client.submit_group({"id": "g", "worker_id": "0001"}, max_wait_s=0.5, sleep=lambda _s: None)
    assert hostile.calls >= 2  # tried again, as after no answer  # type: ignore[attr-defined]


def serve(state_dir: Path) -> ServedController:
    return ServedController(state_dir, TOKEN, {"autoscaler": {"min_workers": 0}}, batch_size=1)


@pytest.mark.parametrize("mode", ["html", "forbidden"])
def test_a_worker_keeps_its_group_until_controller_json_names_the_controller(
        hostile: ThreadingHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """The worker's address answers with a web page, or as another job's controller does (403);
    the group goes to the controller once ``controller.json`` names it. Before, the submit raised
    a JSONDecodeError, or an ApiError (403) as for an invalid group: the group was lost."""
    hostile.mode = mode  # type: ignore[attr-defined]
    monkeypatch.setenv("SLURM_ELASTIC_WORKER_ID", "0001")
    monkeypatch.setenv("SLURM_ELASTIC_CONTROLLER_URL", url(hostile))
    monkeypatch.setenv("SLURM_ELASTIC_TOKEN", TOKEN)
    monkeypatch.setenv("SLURM_ELASTIC_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("SLURM_ELASTIC_HEARTBEAT_INTERVAL_S", "0.2")
    served: list[ServedController] = []

    def controller_comes() -> None:
        served.append(serve(tmp_path))
        publish(tmp_path, served[0].url, 1)

    with RolloutWorker.from_env() as worker:
        threading.Timer(1.0, controller_comes).start()
        answer = worker.submit({"id": "g1", "policy_version": 0, "group_size": 1,
                                "sequences": [{"tokens": [1, 2], "score": 1.0}]})
    try:
        assert answer["accepted"] is True and hostile.calls >= 1  # type: ignore[attr-defined]
        assert served[0].queue.stats()["queued_groups"] == 1
    finally:
        served[0].close()


def test_a_trainer_pulls_through_a_garbled_answer(hostile: ThreadingHTTPServer, tmp_path: Path) -> None:
    """Before, the trainer's registration and pulls raised a JSONDecodeError, and the trainer died."""
    served = serve(tmp_path)
    try:
        publish(tmp_path, served.url, 1)  # the controller is elsewhere than the address the trainer got
        served.queue.submit("g1", "0001", 1, 0, b'{"id":"g1","worker_id":"0001","policy_version":0,"group_size":1,'
                                                b'"sequences":[{"tokens":[1],"score":1.0}]}')
        trainer = Trainer(url(hostile), TOKEN, state_dir=tmp_path, poll_s=0.05)
        try:
            batch = trainer.next_batch(timeout_s=10)
            assert batch is not None and [g["id"] for g in batch.groups] == ["g1"]
            trainer.ack(batch)
        finally:
            trainer.close()
        assert hostile.calls >= 1  # type: ignore[attr-defined]
    finally:
        served.close()


def test_a_routers_load_reports_live_through_a_garbled_answer(hostile: ThreadingHTTPServer) -> None:
    """Before, the JSONDecodeError ended the report thread (no load report ever again) and close() raised it."""
    router = Router(url(hostile), TOKEN, report_interval_s=0.05, poll_wait_s=0.1)
    try:
        router.report_now()
        time.sleep(0.3)
        assert router._threads[1].is_alive()
    finally:
        router.close()


@pytest.mark.parametrize("mode", ["forbidden", "not-found"])
def test_heartbeats_follow_controller_json_past_a_server_that_refuses_them(
        hostile: ThreadingHTTPServer, tmp_path: Path, mode: str) -> None:
    """Another server on the controller's old port answers 403 (another job's controller) or 404
    for ever: once ``controller.json`` names the controller, the next heartbeat goes there. Before,
    only a call with no answer read the file again: the worker heart-beat into the other server."""
    from slurm_elastic.client.step_calls import StepControlClient
    from slurm_elastic.worker.control import FollowingControl

    hostile.mode = mode  # type: ignore[attr-defined]
    served = serve(tmp_path).launched("0001")
    try:
        publish(tmp_path, url(hostile), 1)
        line = FollowingControl("0001", url(hostile), TOKEN, tmp_path, connect=StepControlClient)
        with pytest.raises(KeyError if mode == "not-found" else ApiError):
            line.register({"node": "node1", "gpus": [0]})
        publish(tmp_path, served.url, 1)  # the restarted controller says where it is
        assert line.register({"node": "node1", "gpus": [0]})
        assert line.client.url == served.url
        assert isinstance(line.heartbeat({"rollouts": 1}), dict)
        line.close()
    finally:
        served.close()
