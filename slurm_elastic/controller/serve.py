"""Serve the controller's API: uvicorn in a background thread, on a socket bound up front, its
connections capped below the open-files limit and idle or slow request heads cut off
(:mod:`slurm_elastic.controller.connections`).

Built on uvicorn's public settings only: ``http=`` takes an asyncio protocol class, and the one
given is :class:`~slurm_elastic.controller.connections.GuardedConnection` holding the
implementation uvicorn names ``"httptools"`` (:func:`http_protocol_class`). uvicorn's own limits
do not cover these cases: ``timeout_keep_alive`` times only the wait after a response, and the
first byte of the next head stops it (a connection that never sends a request, or sends its head
a byte at a time, is never cut off), ``limit_concurrency``
answers 503 once a head has been parsed and keeps the connection's descriptor, and
``h11_max_incomplete_event_size`` holds only for the pure-Python h11 implementation (the
httptools parser takes a head of any size); and uvicorn's httptools implementation appends a
chunked body's trailer fields to the request's headers, so a token or any other field sent
after the body would count as sent before it. Heads are held to 64 KiB, answered 431 past it,
and trailer fields are dropped (:func:`~slurm_elastic.controller.framing.framed`; RFC 9112 lets
a recipient discard them); a client that shuts its sending side still gets the answer due
(uvicorn closes such a connection at once). The token
and the body's size are checked in the ASGI app, before routing
(:class:`~slurm_elastic.controller.guard.RequestGuard`). No WebSocket implementation is loaded
(``ws="none"``): a request asking for an upgrade without a body is an HTTP request like any other
(one with a body is refused, :class:`~slurm_elastic.controller.guard.RequestGuard`)."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from slurm_elastic.controller.connections import ConnectionBook, guarded
from slurm_elastic.controller.framing import framed
from slurm_elastic.controller.open_files import connection_cap, raise_open_files_limit
from slurm_elastic.host_address import reachable_address

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0  # a request head must arrive whole within this long of the connection waiting for it
WRITE_TIMEOUT_S = 30.0  # a connection whose waiting response sends too little in a window this long is closed
MIN_SEND_RATE_BYTES_PER_S = 64 * 1024  # too little: under this rate (1.9 MiB a window; a 1 Mbit/s link does twice that)
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this long (at least: keep_alive_for)
KEEP_ALIVE_MARGIN_S = 5  # past the longest interval at which a client calls again
HTTP_IMPLEMENTATION = "httptools"  # uvicorn's HTTP/1.1 implementation on httptools (C)


def default_listen_host() -> str:
    """This host's address as other nodes reach it (the batch host's): see
    :func:`~slurm_elastic.host_address.reachable_address`; how it was found is logged."""
    address, how = reachable_address()
    if how.startswith("loopback"):
        log.warning("%s: workers on other hosts cannot reach the controller; set controller.listen_host", how)
    elif how != "this host's name":
        log.info("%s: listening on %s; set controller.listen_host to choose", how, address)
    return address


NOISE_LOG_INTERVAL_S = 60.0
CLIENT_NOISE = ("Invalid HTTP request received.", "Unsupported upgrade request.", "No supported WebSocket library",
                "refused a trainer call")  # the last: a superseded trainer that goes on calling


class ClientNoise(logging.Filter):
    """uvicorn's warning for each malformed request (it answers a bare 400) or upgrade request a
    client sends, and ours for each trainer call refused for its session, logged once a minute at
    most with how many were left out: a client cannot fill the controller's log. Other records pass."""

    def __init__(self, interval_s: float = NOISE_LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self.last_s, self.left_out = -math.inf, 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(CLIENT_NOISE):
            return True
        now_s = self.clock()
        if now_s - self.last_s < self.interval_s:
            self.left_out += 1
            return False
        if self.left_out:
            record.msg, record.args = f"{message} ({self.left_out} more such warnings left out since the last)", ()
        self.last_s, self.left_out = now_s, 0
        return True


def quiet_client_noise(logger: logging.Logger) -> None:
    """Put one :class:`ClientNoise` on ``logger`` (again: nothing)."""
    if not any(isinstance(f, ClientNoise) for f in logger.filters):
        logger.addFilter(ClientNoise())


def http_protocol_class(name: str = HTTP_IMPLEMENTATION) -> type[asyncio.Protocol]:
    """The asyncio protocol class uvicorn runs for its setting ``http=name``, found in uvicorn's
    own table of implementations. It is wrapped (:func:`~slurm_elastic.controller.connections.guarded`),
    not subclassed: it is constructed with the arguments uvicorn passes and spoken to only
    through asyncio's Protocol and Transport interfaces."""
    protocol = import_from_string(HTTP_PROTOCOLS[name])
    if not (isinstance(protocol, type) and issubclass(protocol, asyncio.Protocol)):
        raise TypeError(f"uvicorn's http={name!r} is {protocol!r}, not an asyncio protocol class")
    return protocol


def keep_alive_for(*intervals_s: float) -> int:
    """How long an idle connection stays open: past the longest of ``intervals_s`` at which clients
    call again (heart-beating workers, node agents), so that each call finds its connection open (a
    new TCP connection per heartbeat costs the controller 30 % more CPU); KEEP_ALIVE_S at least.
    Idle connections hold no slot under pressure: the oldest is closed to make room for a new one."""
    return max(KEEP_ALIVE_S, math.ceil(max(intervals_s, default=0.0)) + KEEP_ALIVE_MARGIN_S)


class ApiServer:
    """uvicorn serving ``app`` on ``host:port`` (0 = any free port) in a daemon thread.

    The process's soft open-files limit is raised to its hard limit, and client connections are
    capped below it (``max_connections``, default :func:`connection_cap`), so that the
    controller's own files (state, store) open however many clients connect. The book of
    connections is also ``app.state.connections``, for the app to report."""

    def __init__(self, app: FastAPI, host: str, port: int = 0, head_timeout_s: float = HEAD_TIMEOUT_S,
                 max_connections: int | None = None, write_timeout_s: float = WRITE_TIMEOUT_S,
                 min_send_rate_bytes_per_s: float = MIN_SEND_RATE_BYTES_PER_S, keep_alive_s: int = KEEP_ALIVE_S) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, int(self.sock.getsockname()[1])
        self.connections = ConnectionBook(max_connections or connection_cap(raise_open_files_limit()),
                                          head_timeout_s, idle_s=keep_alive_s, write_timeout_s=write_timeout_s,
                                          min_send_rate_bytes_per_s=min_send_rate_bytes_per_s)
        app.state.connections = self.connections  # the app reports them (/metrics)
        protocol = guarded(framed(http_protocol_class(), self.connections.head_max_bytes), self.connections)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2, http=protocol,
                                timeout_keep_alive=keep_alive_s, ws="none",  # an Upgrade request is plain HTTP
                                proxy_headers=False)  # clients reach the controller directly, never via a proxy
        quiet_client_noise(logging.getLogger("uvicorn.error"))  # after uvicorn.Config set its logging up
        quiet_client_noise(logging.getLogger("slurm_elastic.controller.http_errors"))
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
        submit = getattr(self.app, "submit_endpoint", None)
        if submit is not None:
            submit.close()  # its parser process, if a large submit started one
