"""Request heads and connection ends a hostile client shapes, on the controller's real server: one
64 KiB cap on a head whatever the reads, answered 431; a missing or second ``Host`` answered 400;
a request behind a body-less ``Upgrade`` one not left unanswered on an open connection; and a
client that shuts its sending side after its request (``nc -N``) answered, while a long-poll whose
client left still ends with it."""

from __future__ import annotations

import itertools
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from slurm_elastic.controller.framing import HEAD_MAX_BYTES
from tests.unit.served_controller import ServedController

TOKEN = "heads-token"
AUTH = b"authorization: Bearer " + TOKEN.encode() + b"\r\n"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedController]:
    server = ServedController(tmp_path_factory.mktemp("heads"), TOKEN)
    yield server
    server.close()


def talk(served: ServedController, *writes: bytes, shut: bool = False, gap_s: float = 0.05) -> tuple[bytes, float]:
    """``writes`` sent ``gap_s`` apart (each its own read, mostly), then the write side shut if
    ``shut``; everything answered until the server closes, and how long after the last write."""
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as conn:
        for i, data in enumerate(writes):
            if i:
                time.sleep(gap_s)
            conn.sendall(data)
        if shut:
            conn.shutdown(socket.SHUT_WR)
        sent_s, answer = time.monotonic(), b""
        while data := conn.recv(65536):
            answer += data
        return answer, time.monotonic() - sent_s


def statuses(answer: bytes) -> list[int]:
    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)]


def state(served: ServedController) -> tuple[Any, ...]:
    return served.controller.state.manual_target, served.controller.state.paused


def scale(workers: int, head_bytes: int = 0, closing: bool = True) -> bytes:
    """``POST /admin/scale`` whose head is ``head_bytes`` long (padded with header fields)."""
    body = b'{"workers": %d}' % workers
    head = b"POST /admin/scale HTTP/1.1\r\nhost: x\r\n" + AUTH + b"content-length: %d\r\n" % len(body)
    head += b"connection: close\r\n" if closing else b""
    while head_bytes and len(head) + 2 < head_bytes:  # fields of 2-20 bytes, as 8,000 headers would be
        head += b"x-%d: %s\r\n" % (len(head), b"v" * min(10, head_bytes - len(head) - 12))
    return head + b"\r\n" + body


def pieces(data: bytes, *cuts: int) -> list[bytes]:
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize("how", ["one write", "three writes", "the end alone", "the end split"])
def test_a_head_over_64_kib_gets_431_whatever_the_reads_and_changes_nothing(served: ServedController,
                                                                            how: str) -> None:
    """Before, a 78 KB head of 8,000 fields sent in one write was served, and one whose reads
    passed the cap before its end was reset without an answer."""
    before, refused = state(served), served.server.connections.head_too_large
    request = scale(5, HEAD_MAX_BYTES + 1000)
    end = request.index(b"\r\n\r\n")
    writes = {"one write": [request], "three writes": pieces(request, 30_000, 60_000),
              "the end alone": pieces(request, end), "the end split": pieces(request, end + 2)}[how]
    answer, after_s = talk(served, *writes)
    assert statuses(answer) == [431], (how, answer[:300])
    assert b"connection: close" in answer and b"over 65536 bytes" in answer
    assert after_s < 1.5 and state(served) == before
    assert served.server.connections.head_too_large == refused + 1  # /metrics: closed, reason head_too_large


@pytest.mark.parametrize("how", ["one write", "three writes", "the end alone"])
def test_a_head_just_under_the_cap_is_served_whatever_the_reads(served: ServedController, how: str) -> None:
    request = scale(3, HEAD_MAX_BYTES - 200)
    end = request.index(b"\r\n\r\n")
    writes = {"one write": [request], "three writes": pieces(request, 30_000, 60_000),
              "the end alone": pieces(request, end)}[how]
    answer, _ = talk(served, *writes)
    assert statuses(answer) == [200], (how, answer[:300])
    assert served.controller.state.manual_target == 3


def test_a_head_over_the_cap_pipelined_in_one_write_is_answered_431_after_the_one_before(
        served: ServedController) -> None:
    """The HTTP parser counts every head it reads: one behind another in the same read was taken
    whole (the connection looked only at the first head's end)."""
    before = state(served)
    quick = b"GET /healthz HTTP/1.1\r\nhost: x\r\n" + AUTH + b"\r\n"
    answer, _ = talk(served, quick + scale(6, HEAD_MAX_BYTES + 1000))
    assert statuses(answer) == [200, 431], answer[:600]
    assert answer.index(b'{"status":"ok"}') < answer.index(b" 431 ") and state(served) == before


def test_a_head_over_the_cap_behind_a_long_poll_is_answered_431_once_the_poll_has_answered(
        served: ServedController) -> None:
    """Before, the next head's bytes past the cap reset the connection: the poll's answer was lost too."""
    version = httpx.get(served.url + "/endpoints", headers={"Authorization": f"Bearer {TOKEN}"}).json()["version"]
    poll = b"GET /endpoints?version=%d&wait_s=1 HTTP/1.1\r\nhost: x\r\n" % version + AUTH + b"\r\n"
    big = scale(6, HEAD_MAX_BYTES + 5000)
    answer, _ = talk(served, poll, *pieces(big, 20_000, 40_000, 60_000))
    assert statuses(answer) == [200, 431], answer[:600]


@pytest.mark.parametrize(("what", "head", "says"), [
    ("no Host", b"GET /healthz HTTP/1.1\r\n" + AUTH, b"this one has 0"),
    ("two Hosts", b"GET /healthz HTTP/1.1\r\nhost: x\r\nhost: y\r\n" + AUTH, b"this one has 2"),
    ("no Host and no token", b"GET /healthz HTTP/1.1\r\n", b"this one has 0"),
    ("a scale without Host", scale(9).split(b"\r\n\r\n")[0].replace(b"host: x\r\n", b"") + b"\r\n", b"has 0"),
])
def test_an_http_1_1_request_without_exactly_one_host_gets_a_clear_400(served: ServedController, what: str,
                                                                      head: bytes, says: bytes) -> None:
    """RFC 9112 section 3.2; before, it was served. A framing fault of the head: answered before the
    token check (the header counts come first; nothing of the job is said, no body is read)."""
    before = state(served)
    answer, _ = talk(served, head + b"\r\n" + (b'{"workers": 9}' if b"scale" in head else b""))
    assert statuses(answer) == [400], (what, answer[:300])
    assert b"exactly one Host header" in answer and says in answer and b"connection: close" in answer
    assert state(served) == before


def test_an_http_1_0_request_without_host_is_served(served: ServedController) -> None:
    answer, _ = talk(served, b"GET /healthz HTTP/1.0\r\n" + AUTH + b"\r\n")
    assert statuses(answer) == [200] and answer.endswith(b'{"status":"ok"}')


def test_a_request_behind_a_bodyless_upgrade_request_finds_the_connection_closed_at_once(
        served: ServedController) -> None:
    """The HTTP parser reads nothing behind a head that asks to switch protocols: the request
    pipelined behind it in the same write was never answered, and the connection stayed open
    until the keep-alive time (5 s). The first is answered with ``connection: close``, and closed."""
    upgrade = b"POST /admin/pause HTTP/1.1\r\nhost: x\r\n" + AUTH + b"connection: Upgrade\r\nupgrade: h2c\r\n\r\n"
    behind = b"POST /admin/resume HTTP/1.1\r\nhost: x\r\n" + AUTH + b"\r\n"
    answer, after_s = talk(served, upgrade + behind)
    assert statuses(answer) == [200] and b"connection: close" in answer.lower(), answer[:300]
    assert after_s < 2 and served.controller.state.paused  # the first done, the second not
    assert httpx.post(served.url + "/admin/resume", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


@pytest.mark.parametrize("closing", [False, True])
def test_a_client_that_shuts_its_side_after_its_request_gets_the_answer(served: ServedController,
                                                                        closing: bool) -> None:
    """``nc -N``: before, nothing was answered, and the scale was not done."""
    answer, after_s = talk(served, scale(4, closing=closing), shut=True)
    assert statuses(answer) == [200] and answer.endswith(b'{"target_workers":4,"paused":true}'), answer[:300]
    assert served.controller.state.manual_target == 4 and after_s < 1.5  # closed once answered


def test_requests_pipelined_before_the_half_close_are_all_answered(served: ServedController) -> None:
    quick = b"GET /healthz HTTP/1.1\r\nhost: x\r\n" + AUTH + b"\r\n"
    answer, after_s = talk(served, quick + scale(2, closing=False) + quick, shut=True)
    assert statuses(answer) == [200, 200, 200], answer[:600]
    assert served.controller.state.manual_target == 2 and after_s < 1.5


def test_a_half_close_before_the_body_is_whole_changes_nothing(served: ServedController) -> None:
    before = state(served)
    answer, after_s = talk(served, scale(8)[:-3], shut=True)
    assert answer == b"" and after_s < 1.5
    time.sleep(0.2)
    assert state(served) == before


def test_a_long_poll_whose_client_shuts_its_side_is_answered_at_once(served: ServedController) -> None:
    """The poll cannot tell a client that shut its side from one that left (both end the stream):
    it ends as for a client that left, and its answer, the current view, is sent."""
    version = httpx.get(served.url + "/endpoints", headers={"Authorization": f"Bearer {TOKEN}"}).json()["version"]
    poll = b"GET /endpoints?version=%d&wait_s=30 HTTP/1.1\r\nhost: x\r\n" % version + AUTH + b"\r\n"
    answer, after_s = talk(served, poll, shut=True)
    assert statuses(answer) == [200] and b'"version":%d' % version in answer, answer[:300]
    assert after_s < 2 and served.controller.endpoints_changed.waiting() == 0


def test_a_refused_head_behind_an_answer_the_client_does_not_read_is_still_closed(tmp_path: Any) -> None:
    """The 431 waited behind a batch still in the write buffer; a graceful close then waits for a
    client that reads nothing, and the connection held its slot for good (not evictable: sending).
    The write watch now times that close as any other."""
    served = ServedController(tmp_path, TOKEN, batch_size=8)
    try:
        book = served.server.connections
        book.write_timeout_s = 1.0
        for i in range(8):
            served.queue.submit(f"g{i}", "0001", 1, 0, b'{"id": "g%d", "pad": "%s"}' % (i, b"x" * 280_000))
        host, port = served.url.removeprefix("http://").split(":")
        with socket.socket() as conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            conn.connect((host, int(port)))
            conn.sendall(b"POST /trainer/batch HTTP/1.1\r\nhost: x\r\n" + AUTH + b"content-length: 0\r\n\r\n")
            time.sleep(1.0)
            conn.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-pad: " + b"v" * 70_000 + b"\r\n\r\n")
            deadline_s = time.monotonic() + 15
            while book.open and time.monotonic() < deadline_s:
                time.sleep(0.2)
            assert not book.open  # closed by the write watch (before: open, unwatched, for good)
    finally:
        served.close()
