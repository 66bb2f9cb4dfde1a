"""The controller's uvicorn server: uvicorn's own HTTP implementation, found by its setting's
name and wrapped, not subclassed; a response's head and body leave in one send, a head without a
body still leaves, and keep-alive connections go on working."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

from fastapi import FastAPI, Response

from slurm_elastic.controller.inner_transport import InnerTransport
from slurm_elastic.controller.serve import (
    KEEP_ALIVE_S,
    ApiServer,
    http_protocol_class,
    keep_alive_for,
)


class RecordingTransport:
    def __init__(self) -> None:
        self.sends: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.sends.append(data)

    def writelines(self, parts: list[bytes]) -> None:
        self.sends.append(b"".join(parts))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"extra {name}"


def test_a_head_waits_for_its_body_and_a_lone_head_leaves_at_the_end_of_the_turn() -> None:
    async def scenario() -> list[bytes]:
        transport = RecordingTransport()
        written: list[int] = []
        wrapped = InnerTransport(transport, asyncio.get_running_loop(),  # type: ignore[arg-type]
                                 lambda nbytes, _first: written.append(nbytes))
        wrapped.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        assert transport.sends == [] and written == []  # nothing left yet: the connection is not told
        wrapped.write(b"{}")
        assert transport.sends == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]  # one send
        assert written == [len(transport.sends[0])]  # the connection is told how many bytes went
        wrapped.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert transport.sends[-1] == b"HTTP/1.1 204 No Content\r\n\r\n"
        wrapped.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        wrapped.close()  # nothing held back is lost at close
        assert transport.sends[-1] == b"HTTP/1.1 400 Bad Request\r\n\r\n" and transport.closed
        wrapped.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        wrapped.write(b"{}")  # a response pipelined behind the closed one: dropped, not raised
        assert transport.sends[-1] == b"HTTP/1.1 400 Bad Request\r\n\r\n"
        assert wrapped.get_extra_info("peername") == "extra peername"  # the rest is the transport's
        return transport.sends

    assert len(asyncio.run(scenario())) == 3


def test_the_http_implementation_is_uvicorns_httptools_found_by_its_setting_name() -> None:
    protocol = http_protocol_class()
    assert issubclass(protocol, asyncio.Protocol) and "httptools" in protocol.__module__


def test_the_server_serves_through_it_and_keep_alive_connections_go_on() -> None:
    app = FastAPI()

    @app.get("/small")
    def small() -> Response:
        return Response(b'{"ok":true}', media_type="application/json")

    @app.get("/empty")
    def empty() -> Response:
        return Response(status_code=204)

    server = ApiServer(app, "127.0.0.1")
    assert server.connections.max_connections >= 8
    server.start()
    try:
        with socket.create_connection((server.host, server.port), timeout=10) as conn:
            for _ in range(3):
                conn.sendall(b"GET /small HTTP/1.1\r\nhost: x\r\n\r\n")
                answer = b""
                while not answer.endswith(b"}"):
                    answer += conn.recv(65536)
                assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b'\r\n\r\n{"ok":true}')
                conn.sendall(b"GET /empty HTTP/1.1\r\nhost: x\r\n\r\n")
                answer = b""
                while not answer.endswith(b"\r\n\r\n"):
                    answer += conn.recv(65536)
                assert answer.startswith(b"HTTP/1.1 204 No Content\r\n") and answer.endswith(b"\r\n\r\n")
    finally:
        server.stop()


def test_an_idle_connection_stays_open_past_the_longest_interval_clients_call_at() -> None:
    """Workers told to heart-beat every 15 s (the slowest pace at the default 60 s grace) and agents
    every 5 s find their connection open: after a response, the next head may begin until the
    keep-alive time (the longest interval plus a margin), past the head timeout, and must then end
    within the head timeout of its first byte."""
    assert keep_alive_for(15.0, 5.0) == 20 and keep_alive_for(12.01) == 18
    assert keep_alive_for(0.3) == 6 and keep_alive_for() == KEEP_ALIVE_S  # never below the default
    app = FastAPI()

    @app.get("/small")
    def small() -> Response:
        return Response(b'{"ok":true}', media_type="application/json")

    def ask(conn: socket.socket, head: bytes = b"GET /small HTTP/1.1\r\nhost: x\r\n\r\n") -> bytes:
        conn.sendall(head)
        answer = b""
        while not answer.endswith(b"}") and (chunk := conn.recv(65536)):
            answer += chunk
        return answer

    def after_idle(keep_alive_s: int, idle_s: float, head_wait_s: float = 0.0) -> bytes:
        """A second request, sent ``idle_s`` after the first's answer (its first byte ``head_wait_s``
        before the rest): its answer, or b"" for a closed connection."""
        server = ApiServer(app, "127.0.0.1", head_timeout_s=1.0, keep_alive_s=keep_alive_s)
        server.start()
        try:
            with socket.create_connection((server.host, server.port), timeout=10) as conn:
                assert ask(conn).endswith(b'{"ok":true}')
                time.sleep(idle_s)
                with contextlib.suppress(OSError):  # closed: the send may fail
                    if head_wait_s:
                        conn.sendall(b"G")
                        time.sleep(head_wait_s)
                        return ask(conn, b"ET /small HTTP/1.1\r\nhost: x\r\n\r\n")
                    return ask(conn)
                return b""
        finally:
            server.stop()

    assert after_idle(keep_alive_s=4, idle_s=2.0).endswith(b'{"ok":true}')  # idle past the 1 s head timeout
    assert after_idle(keep_alive_s=1, idle_s=3.0) == b""  # past the keep-alive time: closed
    assert after_idle(keep_alive_s=6, idle_s=0.5, head_wait_s=3.0) == b""  # a head begun must end within 1 s


def _served(keep_alive_s: int) -> tuple[ApiServer, FastAPI]:
    app = FastAPI()

    @app.get("/slow")
    async def slow() -> Response:
        await asyncio.sleep(0.5)
        return Response(b'{"ok":true}', media_type="application/json")

    server = ApiServer(app, "127.0.0.1", head_timeout_s=1.0, keep_alive_s=keep_alive_s)
    server.start()
    return server, app


def _closed_within(conn: socket.socket, limit_s: float) -> float | None:
    """Seconds until the server closed ``conn`` (reading and dropping what comes), None if not within ``limit_s``."""
    started = time.monotonic()
    conn.settimeout(0.1)
    while time.monotonic() - started < limit_s:
        try:
            if conn.recv(65536) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - started
    return None


def test_a_head_begun_while_the_answer_was_due_has_the_head_timeout_not_the_keep_alive_time() -> None:
    server, _app = _served(keep_alive_s=6)
    try:
        with socket.create_connection((server.host, server.port), timeout=10) as conn:
            conn.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
            time.sleep(0.1)
            conn.sendall(b"GET /slow HTTP/1.1\r\nhost: x")  # the next head begun, never ended
            closed_s = _closed_within(conn, 5.0)
        assert closed_s is not None and closed_s < 3.0, closed_s  # 0.5 s answer + 1 s head timeout, not 6 s
    finally:
        server.stop()


def test_a_request_answered_before_its_body_came_closes_its_connection() -> None:
    """A 404 for a POST whose body was not sent: what comes next is that body, never a head (a body
    holding ``\\r\\n\\r\\n`` kept the connection open with no time limit and its next head uncapped)."""
    server, _app = _served(keep_alive_s=6)
    try:
        with socket.create_connection((server.host, server.port), timeout=10) as conn:
            conn.sendall(b"POST /nope HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\n")
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += conn.recv(65536)
            assert answer.startswith(b"HTTP/1.1 404")
            with contextlib.suppress(OSError):
                conn.sendall(b"x\r\n\r\n")
            closed_s = _closed_within(conn, 5.0)
        assert closed_s is not None and closed_s < 2.0, closed_s
    finally:
        server.stop()
