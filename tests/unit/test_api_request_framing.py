"""How the controller's HTTP server frames requests a hostile client shapes oddly: the fields of a
chunked body's trailer are no headers (a token sent after the body does not count), and a
request that asks to switch protocols (``curl --http2``'s ``Upgrade: h2c``) with a body is
refused with a clear answer instead of reaching its route without its body. After each, nothing
changed and a good client is answered at once."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.unit.served_controller import ServedController

TOKEN = "framing-token"
AUTH = b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
SCALE = b'{"workers": 7}'


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedController]:
    server = ServedController(tmp_path_factory.mktemp("framing"), TOKEN)
    yield server
    server.close()


def exchange(served: ServedController, request: bytes) -> bytes:
    """``request`` sent whole in one write; the first answer (the connection may stay open)."""
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = conn.recv(65536)
            if not data:
                break
            answer += data
    return answer


def state(served: ServedController) -> tuple[Any, ...]:
    return served.controller.state.manual_target, served.controller.state.paused, served.queue.stats()["queued_groups"]


def good_client_answered(served: ServedController) -> None:
    started = time.monotonic()
    answer = httpx.get(served.url + "/healthz", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert answer.status_code == 200 and time.monotonic() - started < 2


def chunked(path: bytes, head: bytes, body: bytes, trailer: bytes) -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: x\r\n" + head + b"Transfer-Encoding: chunked\r\n\r\n"
            + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n" + trailer + b"\r\n")


def test_a_token_sent_in_a_trailer_after_the_body_does_not_count(served: ServedController) -> None:
    before = state(served)
    answer = exchange(served, chunked(b"/admin/scale", b"", SCALE, AUTH))
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:300]
    assert state(served) == before
    good_client_answered(served)


def test_a_trailer_field_is_dropped_not_taken_as_a_header(served: ServedController) -> None:
    """A second Authorization (or a Content-Type) in the trailer is no second header: the request
    is served as its head and body say."""
    trailer = b"Authorization: Bearer wrong\r\nContent-Type: text/plain\r\n"
    answer = exchange(served, chunked(b"/admin/scale", AUTH, SCALE, trailer))
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert b'"target_workers":7' in answer
    assert served.controller.state.manual_target == 7
    assert exchange(served, chunked(b"/admin/resume", AUTH, b"{}", b"")).startswith(b"HTTP/1.1 200 ")
    good_client_answered(served)


@pytest.mark.parametrize(("what", "framing"), [
    ("Content-Length", b"Content-Length: 14\r\n\r\n" + SCALE),
    ("chunked", b"Transfer-Encoding: chunked\r\n\r\ne\r\n" + SCALE + b"\r\n0\r\n\r\n"),
])
@pytest.mark.parametrize("connection", [b"Upgrade, HTTP2-Settings", b"keep-alive , upgrade"])
def test_a_request_asking_to_switch_protocols_with_a_body_gets_a_clear_400(
        served: ServedController, what: str, framing: bytes, connection: bytes) -> None:
    """``curl --http2 -d ...`` over http:// sends ``Upgrade: h2c``: the HTTP parser stops at such a
    head, and the route answered 422 "Field required" for a body it never got."""
    before = state(served)
    head = (b"POST /admin/scale HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Connection: " + connection
            + b"\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\nContent-Type: application/json\r\n")
    answer = exchange(served, head + framing)
    assert answer.startswith(b"HTTP/1.1 400 "), (what, answer[:300])
    assert b"switch protocols" in answer and b"--http1.1" in answer and b"connection: close" in answer.lower()
    assert state(served) == before
    good_client_answered(served)


def test_a_request_asking_to_switch_protocols_without_a_body_is_answered_as_plain_http(
        served: ServedController) -> None:
    answer = exchange(served, b"POST /admin/pause HTTP/1.1\r\nHost: x\r\n" + AUTH
                      + b"Connection: Upgrade\r\nUpgrade: h2c\r\nContent-Length: 0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert served.controller.state.paused
    assert httpx.post(served.url + "/admin/resume", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_the_same_body_without_the_upgrade_is_served(served: ServedController) -> None:
    answer = exchange(served, b"POST /admin/scale HTTP/1.1\r\nHost: x\r\n" + AUTH
                      + b"Upgrade: h2c\r\nContent-Length: 14\r\n\r\n" + SCALE)  # Upgrade without Connection: upgrade
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert httpx.post(served.url + "/admin/resume", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200

