"""Hostile and broken clients with the job's token, on the controller's real HTTP server (a real
controller object, a real rollout store on disk): values JSON has no text for, loose types and
unbounded numbers on every JSON route get a 422 naming the field and change nothing, and a body
that never arrives whole gets 408 and gives its connection back while other clients are served."""

from __future__ import annotations

import json
import logging
import math
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slurm_elastic.controller.serve import ClientNoise
from tests.unit.served_controller import ServedController

TOKEN = "hostile-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
BODY_TIMEOUT_S = 1.0


class Served(ServedController):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, TOKEN, body_timeout_s=BODY_TIMEOUT_S)

    def post(self, path: str, body: str | bytes) -> httpx.Response:
        return httpx.post(self.url + path, content=body, headers=AUTH, timeout=30)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server = Served(tmp_path_factory.mktemp("hostile"))
    yield server
    server.close()


def strict_json(text: str) -> Any:
    """``text`` parsed as JSON proper: ``NaN`` and ``Infinity`` are not JSON."""
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} in the answer")
    return json.loads(text, parse_constant=refuse)


def unchanged(served: Served) -> tuple[Any, ...]:
    state = served.controller.state
    return state.manual_target, state.paused, dict(state.cordons.cordoned()), served.queue.stats()["policy_version"]


GPU = '{"node":"node1","index":0,"temperature_c":40.0}'
REPORT = '{"node":"node1","sampled_at_s":1.0,"gpus":[' + GPU + "]}"


@pytest.mark.parametrize(("what", "path", "body", "named"), [
    ("scale to NaN workers", "/admin/scale", '{"workers": NaN}', "workers"),
    ("scale to Infinity workers", "/admin/scale", '{"workers": Infinity}', "workers"),
    ("scale to true workers", "/admin/scale", '{"workers": true}', "workers"),
    ("scale to \"3\" workers", "/admin/scale", '{"workers": "3"}', "workers"),
    ("scale to 2.0 workers", "/admin/scale", '{"workers": 2.0}', "workers"),
    ("heartbeat with busy_s NaN", "/workers/0001/heartbeat", '{"busy_s": NaN}', "busy_s"),
    ("heartbeat with rollouts \"5\"", "/workers/0001/heartbeat", '{"rollouts": "5"}', "rollouts"),
    ("load report with sent NaN", "/endpoints/load", '{"client_id": "r", "sent": NaN}', "sent"),
    ("load report with outstanding 1.5", "/endpoints/load", '{"client_id": "r", "outstanding": {"0001": 1.5}}',
     "outstanding"),
    ("cordon with a lone surrogate in the reason", "/admin/cordon", '{"node": "node1", "gpu": 0, "reason": "a\\ud800"}',
     "reason"),
    ("cordon GPU \"0\"", "/admin/cordon", '{"node": "node1", "gpu": "0"}', "gpu"),
    ("admission for 1e3 sequences", "/rollouts/admission", '{"sequences": 1e3, "worker_id": "0001"}', "sequences"),
    ("publish version NaN", "/trainer/version", '{"version": NaN}', "version"),
    ("publish version \"1\"", "/trainer/version", '{"version": "1"}', "version"),
    ("publish recovered 1", "/trainer/version", '{"version": 0, "recovered": 1}', "recovered"),
    ("agent report at NaN", "/agent/report", REPORT.replace('"sampled_at_s":1.0', '"sampled_at_s":NaN'),
     "sampled_at_s"),
    ("agent report of temperature NaN", "/agent/report", REPORT.replace("40.0", "NaN"), "temperature_c"),
    ("agent report of temperature Infinity", "/agent/report", REPORT.replace("40.0", "Infinity"), "temperature_c"),
    ("agent report of GPU 10^23", "/agent/report", REPORT.replace('"index":0', '"index":99999999999999999999999'),
     "index"),
    ("agent report of -5 MB used", "/agent/report", REPORT.replace("40.0", '40.0,"memory_used_mb":-5'),
     "memory_used_mb"),
    ("agent report of -1 uncorrectable errors", "/agent/report",
     REPORT.replace("40.0", '40.0,"ecc_uncorrectable_volatile":-1'), "ecc_uncorrectable_volatile"),
])
def test_bad_values_get_422_naming_the_field_and_change_nothing(served: Served, what: str, path: str, body: str,
                                                                named: str) -> None:
    before = unchanged(served)
    answer = served.post(path, body)
    assert answer.status_code == 422, (what, answer.status_code, answer.text)
    detail = strict_json(answer.text)["detail"]
    assert any(named in map(str, error["loc"]) for error in detail), (what, detail)
    assert unchanged(served) == before, what


def test_the_good_forms_of_those_bodies_still_pass(served: Served) -> None:
    assert served.post("/agent/report", REPORT).status_code == 200
    assert served.post("/endpoints/load", '{"client_id": "r", "sent": 3, "outstanding": {"0001": 1}}').status_code == 200
    assert served.post("/admin/cordon", '{"node": "node1", "gpu": 1, "reason": "fan é"}').status_code == 200
    assert served.post("/admin/uncordon", '{"node": "node1", "gpu": 1}').status_code == 200
    assert served.post("/admin/scale", '{"workers": 0}').json() == {"target_workers": 0, "paused": True}
    assert served.post("/admin/resume", "").status_code == 200


def raw_request(url: str, head: bytes, body_start: bytes, trickle: bytes) -> tuple[bytes, float]:
    """Send ``head`` and ``body_start``, then ``trickle`` a byte every 0.2 s (never the whole
    body); the server's answer and when it came, in seconds after the head."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        started = time.monotonic()
        conn.sendall(head + body_start)
        conn.settimeout(0.2)
        answer = b""
        for i in range(300):
            try:
                data = conn.recv(65536)
            except TimeoutError:
                try:
                    conn.sendall(trickle[i % len(trickle):][:1] if trickle else b"")
                except OSError:
                    break  # closed under us
                continue
            if not data:
                break
            answer += data
        return answer, time.monotonic() - started


@pytest.mark.parametrize(("what", "head", "body_start", "trickle"), [
    ("a body sent a byte at a time", b"POST /admin/scale HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n", b"{", b" "),
    ("a body shorter than its Content-Length", b"POST /rollouts HTTP/1.1\r\nhost: x\r\ncontent-length: 50\r\n",
     b'{"id": "x"}', b""),
    ("a chunked body that never ends", b"POST /trainer/version HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n",
     b"1\r\n{\r\n", b"1\r\n \r\n"),
])
def test_a_body_that_never_arrives_whole_gets_408_and_its_connection_closed(
        served: Served, what: str, head: bytes, body_start: bytes, trickle: bytes) -> None:
    before = unchanged(served)
    head += f"authorization: Bearer {TOKEN}\r\ncontent-type: application/json\r\n\r\n".encode()
    answer, after_s = raw_request(served.url, head, body_start, trickle or b"")
    assert answer.startswith(b"HTTP/1.1 408 "), (what, answer[:200])
    assert b"connection: close" in answer.lower() and b"not received whole within 1 s" in answer, answer
    assert after_s < 30, f"{what}: answered after {after_s:.1f} s (body timeout {BODY_TIMEOUT_S} s)"
    assert unchanged(served) == before, what


def test_other_clients_are_served_while_bodies_trickle(served: Served) -> None:
    host, port = served.url.removeprefix("http://").split(":")
    slow = [socket.create_connection((host, int(port)), timeout=10) for _ in range(20)]
    try:
        for conn in slow:
            conn.sendall(f"POST /admin/pause HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n"
                         "content-type: application/json\r\ncontent-length: 100\r\n\r\n{".encode())
        answer = httpx.get(served.url + "/global-status", headers=AUTH, timeout=10)
        assert answer.status_code == 200
    finally:
        for conn in slow:
            conn.close()


def test_a_route_that_takes_no_body_is_not_timed_on_one(served: Served) -> None:
    """A long-poll sent with a body it never reads answers when it is due, not 408 at the body timeout."""
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=30) as http:
        version = http.get("/endpoints").json()["version"]
        answer = http.request("GET", f"/endpoints?version={version}&wait_s={3 * BODY_TIMEOUT_S}", content=b"{}")
    assert answer.status_code == 200 and answer.json()["version"] == version


@pytest.mark.parametrize(("what", "first", "second"), [
    ("the wrong token first", "Bearer wrong", f"Bearer {TOKEN}"),
    ("the right token first", f"Bearer {TOKEN}", "Bearer wrong"),
    ("the right token twice", f"Bearer {TOKEN}", f"Bearer {TOKEN}"),
])
def test_two_authorization_headers_get_400_before_the_body_is_read(
        served: Served, what: str, first: str, second: str) -> None:
    """Whichever header a server or proxy would pick, a request naming two tokens is refused whole."""
    before = unchanged(served)
    head = (f"POST /admin/scale HTTP/1.1\r\nhost: x\r\nauthorization: {first}\r\nauthorization: {second}\r\n"
            "content-type: application/json\r\ncontent-length: 1000\r\n\r\n").encode()
    answer, _after_s = raw_request(served.url, head, b'{"workers": 0}', b"")
    assert answer.startswith(b"HTTP/1.1 400 "), (what, answer[:200])
    assert b"more than one Authorization header" in answer and b"connection: close" in answer.lower(), answer
    assert unchanged(served) == before, what


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_malformed_requests_without_a_token_cannot_fill_the_log(served: Served) -> None:
    """uvicorn warns once per malformed request; a client sending hundreds gets one line a minute."""
    records = Records()
    logging.getLogger("uvicorn.error").addHandler(records)
    try:
        host, port = served.url.removeprefix("http://").split(":")
        for _ in range(200):
            with socket.create_connection((host, int(port)), timeout=10) as conn:
                conn.sendall(b"GET / HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n")
                assert conn.recv(1024).startswith(b"HTTP/1.1 400 ")
    finally:
        logging.getLogger("uvicorn.error").removeHandler(records)
    assert len([m for m in records.messages if m.startswith("Invalid HTTP request")]) <= 1, records.messages


def test_the_noise_filter_says_how_many_it_left_out() -> None:
    now = [0.0]
    noise = ClientNoise(interval_s=60.0, clock=lambda: now[0])

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, message, (), None)

    assert noise.filter(record("Invalid HTTP request received."))
    assert not any(noise.filter(record("Invalid HTTP request received.")) for _ in range(5))
    assert noise.filter(record("Exceeded concurrency limit."))  # not a client's noise: always
    now[0] = 61.0
    later = record("Invalid HTTP request received.")
    assert noise.filter(later) and later.getMessage().endswith("(5 more such warnings left out since the last)")


def test_a_superseded_trainer_that_goes_on_calling_is_logged_once_a_minute() -> None:
    from fastapi import FastAPI

    from slurm_elastic.controller.serve import ApiServer

    server = ApiServer(FastAPI(), "127.0.0.1")  # puts the filter on the logger the refusals go to
    server.sock.close()
    (noise,) = [f for f in logging.getLogger("slurm_elastic.controller.http_errors").filters
                if isinstance(f, ClientNoise)]
    refusal = "refused a trainer call: trainer_session 1 is not the newest registration (2)"

    def record() -> logging.LogRecord:
        return logging.LogRecord("slurm_elastic.controller.http_errors", logging.WARNING, __file__, 1, refusal, (), None)

    noise.last_s, noise.left_out = -math.inf, 0
    assert noise.filter(record()) and not any(noise.filter(record()) for _ in range(100))


def _raw_answer(served: Served, request_line: str) -> bytes:
    """The status line of an answer to ``request_line`` sent as is (no client normalises its path)."""
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(f"{request_line}\r\nhost: evil.example\r\nauthorization: {AUTH['Authorization']}\r\n"
                     "content-length: 0\r\nconnection: close\r\n\r\n".encode())
        return conn.recv(65536)


@pytest.mark.parametrize("request_line", ["POST /admin%2Fpause HTTP/1.1", "POST /admin%2fpause HTTP/1.1",
                                          "GET /healthz%2F HTTP/1.1", "GET /healthz/ HTTP/1.1"])
def test_an_encoded_slash_or_a_trailing_one_is_no_route(served: Served, request_line: str) -> None:
    """The server decodes %2F: ``POST /admin%2Fpause`` paused the autoscaler; a trailing slash got
    a 307 whose Location was built from the client's Host header."""
    before = unchanged(served)
    answer = _raw_answer(served, request_line)
    assert answer.startswith(b"HTTP/1.1 404 "), answer[:300]
    assert b"location:" not in answer.lower() and unchanged(served) == before


@pytest.mark.parametrize("query", ["version=1&version=2", "wait_s=1&version=0&wait_s=2", "pull_id=a&pull_id=b",
                                   "session=1&session=1"])
def test_a_query_parameter_named_twice_gets_400(served: Served, query: str) -> None:
    """Which of two values a framework takes (the last, here) is not the client's to choose."""
    before = unchanged(served)
    trainer = "pull_id" in query or "session" in query
    url = f"{served.url}{'/trainer/batch' if trainer else '/endpoints'}?{query}"
    answer = httpx.post(url, headers=AUTH, timeout=30) if trainer else httpx.get(url, headers=AUTH, timeout=30)
    assert answer.status_code == 400, (query, answer.text)
    assert "given more than once" in answer.json()["detail"], answer.text
    assert unchanged(served) == before


@pytest.mark.parametrize("wait", ["nan", "inf", "-inf"])
def test_a_long_poll_wait_that_is_no_number_is_named_as_such(served: Served, wait: str) -> None:
    answer = httpx.get(f"{served.url}/endpoints?wait_s={wait}", headers=AUTH, timeout=30)
    assert answer.status_code == 422, answer.text
    assert "finite" in answer.text and "less than or equal to 60" not in answer.text, answer.text
