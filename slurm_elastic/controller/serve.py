"""Serve the controller's API: uvicorn in a background thread, on a socket bound up front, its
connections capped below the open-files limit and idle or slow request heads cut off
(:mod:`slurm_elastic.controller.connections`)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from slurm_elastic.controller.connections import (
    ConnectionBook,
    connection_cap,
    guarded,
    raise_open_files_limit,
)

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0  # a request head must arrive whole within this long of the connection waiting for it
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this long


def default_listen_host() -> str:
    """This host's address as other nodes reach it (the batch host's)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class _HeadWithBody:
    """A transport that holds a response head back until the next write (its body) and sends
    both in one ``writev``; a head with no body follows it at the end of the loop turn. uvicorn
    writes a response's head and its body separately: two sends, two TCP segments and two
    wake-ups of the client for a 17-byte answer. Everything else is the wrapped transport's."""

    __slots__ = ("_head", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        head, self._head = self._head, None
        if head is not None:
            self._transport.writelines([head, data])
        elif data.endswith(b"\r\n\r\n"):  # a head (or a body that ends like one: one turn later)
            self._head = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, sending a response's head and body in one go (:class:`_HeadWithBody`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_HeadWithBody(transport, self.loop))  # type: ignore[arg-type]


class ApiServer:
    """uvicorn serving ``app`` on ``host:port`` (0 = any free port) in a daemon thread.

    The process's soft open-files limit is raised to its hard limit, and client connections are
    capped below it (``max_connections``, default :func:`connection_cap`), so that the
    controller's own files (state, store) open however many clients connect."""

    def __init__(self, app: FastAPI, host: str, port: int = 0, head_timeout_s: float = HEAD_TIMEOUT_S,
                 max_connections: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, int(self.sock.getsockname()[1])
        self.connections = ConnectionBook(max_connections or connection_cap(raise_open_files_limit()),
                                          head_timeout_s)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2, http=guarded(HttpProtocol, self.connections),
                                timeout_keep_alive=KEEP_ALIVE_S,
                                proxy_headers=False)  # clients reach the controller directly, never via a proxy
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, wait_s: float = 10.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + wait_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the API server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()
