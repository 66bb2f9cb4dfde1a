"""The step wrapper's stdlib client against the controller's real app and server: it registers and
heart-beats, maps errors as the httpx client does, and survives a kept-alive connection that the
server closed meanwhile. The wrapper's import path stays free of httpx. Heartbeats the app's fast
path cannot answer (bad body, unknown worker, the lock held by a tick) get the route's answers."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from slurm_elastic.client.step_calls import StepControlClient
from slurm_elastic.controller.app import create_controller_app
from slurm_elastic.controller.beats import HeartbeatEndpoint
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.serve import ApiServer
from slurm_elastic.errors import (
    ApiError,
    ConfigError,
    ControllerUnreachableError,
    UnknownOnControllerError,
)
from tests.stub_backend import ListedSteps, lock_held_elsewhere

TOKEN = "t0ken"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, str, Controller]]:
    """The controller's API with one launched worker: (url, worker id, the controller)."""
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    controller = Controller(config, 1, ListedSteps(), tmp_path, gpus_by_node={"n1": (0, 1)})  # type: ignore[arg-type]
    controller.scale(1)
    controller.tick()
    server = ApiServer(create_controller_app(controller, TOKEN), "127.0.0.1")
    server.start()
    try:
        yield server.url, next(iter(controller.workers)), controller
    finally:
        server.stop()


def test_register_and_heartbeat_through_the_real_server(served: tuple[str, str, Controller], read1_of: str) -> None:
    url, worker_id, _controller = served
    client = StepControlClient(url, TOKEN)
    try:
        answer = client.register(worker_id, {"node": "n1", "gpus": [0], "step_id": "3", "ready": True})
        assert answer["action"] == "run" and answer["worker_id"] == worker_id
        for _ in range(3):  # the same kept-alive connection
            assert client.heartbeat(worker_id, {"busy": True}) == {"drain": False, "hold": False, "register": False, "heartbeat_interval_s": 5.0}
        with pytest.raises(UnknownOnControllerError):
            client.heartbeat("w_nobody", {})
    finally:
        client.close()


@pytest.fixture(params=["this_python", "python_3_12_read1"])
def read1_of(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``http.client`` as it is here, and as Python 3.12+ reads: ``read1`` closes the response (and
    with it the socket of an answer that says ``Connection: close``) once its length runs out."""
    if request.param == "python_3_12_read1" and sys.version_info < (3, 12):
        read1 = http.client.HTTPResponse.read1

        def read1_closing(self: http.client.HTTPResponse, n: int = -1) -> bytes:
            chunk = read1(self, n)
            if chunk and self.length == 0:
                self._close_conn()  # type: ignore[attr-defined]
            return chunk

        monkeypatch.setattr(http.client.HTTPResponse, "read1", read1_closing)
    return str(request.param)


def test_a_wrong_token_is_an_api_error_and_no_server_is_unreachable(
        served: tuple[str, str, Controller], read1_of: str) -> None:
    url, worker_id, _controller = served
    client = StepControlClient(url, TOKEN)
    assert client.register(worker_id, {"node": "n1", "gpus": [0], "step_id": "3", "ready": True})["action"] == "run"
    with pytest.raises(ApiError) as refused:
        StepControlClient(url, "wrong").register(worker_id, {})
    assert refused.value.status_code == 403
    with pytest.raises(ControllerUnreachableError):
        StepControlClient("http://127.0.0.1:9", TOKEN).heartbeat(worker_id, {})
    with pytest.raises(ConfigError):
        StepControlClient("ftp://controller", TOKEN)


class _OneRequestPerConnection(http.server.BaseHTTPRequestHandler):
    """Answers with keep-alive allowed, then closes the connection anyway (an idle timeout)."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *_args: object) -> None:
        pass


def test_a_connection_closed_by_the_server_is_opened_again(read1_of: str) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OneRequestPerConnection)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = StepControlClient(f"http://127.0.0.1:{server.server_address[1]}/prefix", TOKEN)
    try:
        for _ in range(3):
            assert client.heartbeat("w-1", {}) == {"path": "/prefix/workers/w-1/heartbeat"}
    finally:
        client.close()
        server.shutdown()
        server.server_close()


def test_the_step_entry_imports_no_httpx_or_click() -> None:
    code = ("import sys, slurm_elastic.worker.step; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('httpx', 'pydantic', 'fastapi', 'rich', 'jinja2', 'click')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_step_started_as_the_controller_starts_it_registers_and_reports_its_exit(
        served: tuple[str, str, Controller], tmp_path: Path) -> None:
    url, worker_id, controller = served
    env = {**os.environ, "SLURM_ELASTIC_WORKER_ID": worker_id, "SLURM_ELASTIC_CONTROLLER_URL": url,
           "SLURM_ELASTIC_TOKEN": TOKEN, "SLURMD_NODENAME": "n1", "SLURM_STEP_GPUS": "0", "SLURM_STEP_ID": "3"}
    done = subprocess.run([sys.executable, "-m", "slurm_elastic", "worker", "--", sys.executable, "-c",
                           "raise SystemExit(7)"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, done.stderr
    worker = controller.workers[worker_id]
    assert worker.exit_code == 7 and worker.step_id == "3" and worker.history[-1][2] == "ACTIVE"
    bad = subprocess.run([sys.executable, "-m", "slurm_elastic", "worker", "--", "true"],
                         env={k: v for k, v in env.items() if k != "SLURM_ELASTIC_WORKER_ID"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.startswith("slurm-elastic: error: not started by a slurm-elastic")
    token_file = tmp_path / "other-token"
    token_file.write_text("another-jobs-token\n")
    entry = ("import sys; from slurm_elastic.client import refusals; refusals.TOKEN_REFUSED_WAIT_S = 0.5; "
             "from slurm_elastic.worker.step import main; main(sys.argv[1:])")  # the window shortened
    refused = subprocess.run([sys.executable, "-c", entry, "true"],
                             env={**{k: v for k, v in env.items() if k != "SLURM_ELASTIC_TOKEN"},
                                  "SLURM_ELASTIC_TOKEN_FILE": str(token_file)},
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1  # asked again (a restart?), then said in one line naming the token's file
    assert "registration refused (HTTP 403: wrong token for this job)" in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"slurm-elastic: error: HTTP 403: wrong token for this job at {url} on every try (a wrong token, or a "
        f"controller restart still in progress); the token is from SLURM_ELASTIC_TOKEN_FILE ({token_file})")


def _post(url: str, path: str, body: bytes) -> tuple[int, Any]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {TOKEN}",
                                                     "Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_heartbeats_the_fast_path_cannot_answer_get_the_routes_answers(served: tuple[str, str, Controller]) -> None:
    url, worker_id, controller = served
    controller.register_worker(worker_id, {"node": "n1", "gpus": [0], "step_id": "3"})
    endpoint = HeartbeatEndpoint(controller)
    assert endpoint.answer(worker_id, b'{"busy":true}') is not None  # answered at once
    code, answer = _post(url, f"/workers/{worker_id}/heartbeat", b'{"busy":"sometimes"}')
    assert code == 422 and answer["detail"][0]["loc"] == ["body", "busy"]
    code, answer = _post(url, "/workers/w_nobody/heartbeat", b"{}")
    assert code == 404 and "w_nobody" in answer["detail"]
    with lock_held_elsewhere(controller.lock) as release:
        assert endpoint.answer(worker_id, b"{}") is None  # the route answers, waiting in a thread
        before = controller.heartbeats
        threading.Timer(0.2, release.set).start()
        code, answer = _post(url, f"/workers/{worker_id}/heartbeat", b'{"rollouts":4}')
    assert code == 200 and answer == {"drain": False, "hold": False, "register": False, "heartbeat_interval_s": 5.0}
    assert controller.heartbeats == before + 1 and controller.workers[worker_id].rollouts == 4
