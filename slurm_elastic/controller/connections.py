"""Limits on the API's connections, below the HTTP server: how many may be open, and how long
and how large a request head may be.

A connection waiting for a request head (just opened, or after a response) must deliver the
whole head within ``head_timeout_s`` and ``head_max_bytes``, or it is closed: a client that
sends a head a byte at a time, or never sends one, holds no descriptor for long. At most
``max_connections`` are open; one more closes the longest-waiting connection that has no request
in progress and no response still leaving, else the one whose request body began arriving the
longest ago, if ``slow_body_s`` or more ago (a client that sends a head and then its body a byte
at a time, at whatever pace, holds no slot for long: a body takes milliseconds to arrive), or is
itself closed at once if every connection is busy.
An interim answer (``100 Continue``) is no response: the request's body follows it. The cap is
kept below the process's open-files limit so that the controller's own files always open. A response whose bytes
wait in the transport's write buffer must send at least ``min_send_rate_bytes_per_s`` times
``write_timeout_s`` of them in every window of ``write_timeout_s``, or its connection is closed:
a client that never reads its answers (nothing leaves: ``stalled``), or reads them a drip at a
time (``slow``), holds no slot of the cap, and no response in memory, for long; this holds too
once the HTTP server has begun to close the connection (its keep-alive time is up), a close that
waits for the write buffer to empty. Such a connection is reset (``SO_LINGER`` of 0): the kernel
drops what it still holds of the response instead of trying to deliver it for minutes. A
response that fits in the kernel's buffers never waits in the transport's, and is never timed.

:func:`guarded` wraps any asyncio protocol class (uvicorn's ``http=`` setting takes one); it
sees only the asyncio ``Protocol`` and ``Transport`` interfaces, and two attributes of uvicorn's
protocol: ``pipeline`` (the requests that arrived behind the one being answered) and ``cycle``
(the latest request; ``more_body`` false once its whole body is in): bytes after that are the
next request's head, held to the head's size cap even while an answer is pending; and at most
``max_pipelined`` whole requests may wait behind the one being answered (each holds its parsed
head in memory), or the connection is reset. The transport
it hands the wrapped protocol also sends a response's head together with its body
(:class:`_InnerTransport`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import resource
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

HEAD_END = b"\r\n\r\n"
INTERIM = re.compile(rb"HTTP/1\.[01] 1[0-9][0-9] [^\r\n]*\r\n\r\n\Z")  # an interim answer, written whole
RESERVED_FDS = 128  # descriptors kept for the controller itself: store, state files, Slurm commands
MAX_CONNECTIONS = 4096
SLOW_BODY_S = 1.0  # a request body still arriving this long after it began may be closed to make room
MAX_PIPELINED = 32  # requests queued behind the one being answered; one more resets the connection


def _pieces(data: bytes, most_heads: int) -> list[bytes]:
    """``data`` cut after every ``most_heads``-th ``\r\n\r\n`` (a head's end, or a body's blank lines)."""
    if data.count(HEAD_END) <= most_heads:
        return [data]
    pieces, start, seen, at = [], 0, 0, data.find(HEAD_END)
    while at >= 0:
        seen += 1
        if seen % most_heads == 0:
            pieces.append(data[start:at + len(HEAD_END)])
            start = at + len(HEAD_END)
        at = data.find(HEAD_END, at + len(HEAD_END))
    return [*pieces, data[start:]] if start < len(data) else pieces


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_cap(open_files_limit: int) -> int:
    """How many client connections fit under ``open_files_limit`` with the controller's reserve."""
    return max(8, min(MAX_CONNECTIONS, open_files_limit - RESERVED_FDS))


@dataclass
class ConnectionBook:
    """The open connections of one server; those waiting for a head in the order they started waiting."""

    max_connections: int
    head_timeout_s: float
    head_max_bytes: int = 64 * 1024
    write_timeout_s: float = 30.0
    min_send_rate_bytes_per_s: float = 64 * 1024
    slow_body_s: float = SLOW_BODY_S
    max_pipelined: int = MAX_PIPELINED
    open: set[GuardedConnection] = field(default_factory=set)
    waiting: dict[GuardedConnection, None] = field(default_factory=dict)  # insertion order: oldest first
    receiving: dict[GuardedConnection, float] = field(default_factory=dict)  # body still due: since when (oldest first)
    refused: int = 0  # connections closed at once: every open one was busy
    evicted: int = 0  # waiting connections closed to make room
    stalled: int = 0  # connections closed because nothing of their response left for a window
    slow: int = 0  # connections closed because their response left slower than the minimum rate
    overpipelined: int = 0  # connections reset for queueing more than max_pipelined requests

    def admit(self, connection: GuardedConnection) -> bool:
        if len(self.open) >= self.max_connections:
            oldest = next((c for c in self.waiting if not c.sending()), None) or self._slow_body()
            if oldest is None:
                self.refused += 1
                return False
            self.forget(oldest)
            self.evicted += 1
            oldest.abort()
        self.open.add(connection)
        return True

    def _slow_body(self) -> GuardedConnection | None:
        """The connection whose request body began arriving the longest ago, if slow_body_s or more ago."""
        oldest = next(iter(self.receiving.items()), None)
        if (oldest is None or oldest[0].sending()
                or asyncio.get_running_loop().time() - oldest[1] < self.slow_body_s):
            return None
        return oldest[0]

    def forget(self, connection: GuardedConnection) -> None:
        self.open.discard(connection)
        self.waiting.pop(connection, None)
        self.receiving.pop(connection, None)


class GuardedConnection(asyncio.Protocol):
    """One connection: the wrapped protocol, under its book's limits."""

    book: ConnectionBook
    inner_class: Callable[..., asyncio.Protocol]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.inner = self.inner_class(*args, **kwargs)
        self.transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._lost = False
        self._head_bytes = 0
        self._tail = b""  # the last bytes seen while waiting for a head (an end split across reads)
        self._head_begun = False  # a byte other than CR or LF came since waiting began
        self._written = 0  # bytes handed to the transport
        self._window_sent = 0  # of them, those that had left its write buffer when the window began
        self._window_start_s = 0.0
        self._write_watch: asyncio.TimerHandle | None = None
        self._body_cycle: object = None  # the request whose body arrival is timed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        if not self.book.admit(self):
            transport.abort()
            return
        self.transport = transport
        self._wait_for_head()
        inner_transport = _InnerTransport(transport, asyncio.get_running_loop(), self._wrote)
        self.inner.connection_made(cast(asyncio.Transport, inner_transport))

    def _wrote(self, nbytes: int, first: bytes) -> None:
        """A response is going out (``first``: its first bytes written now): the connection waits
        for its next request head, unless that head came in already (a request pipelined behind
        this one, queued in the HTTP protocol) or this is an interim answer (``100 Continue``: the
        request's body comes next)."""
        self._written += nbytes
        if not (INTERIM.match(first) or getattr(self.inner, "pipeline", None)):
            self._wait_for_head()

    def _watch_writes(self) -> None:
        """Look at the write buffer every quarter of ``write_timeout_s`` until it is empty, in
        windows of ``write_timeout_s``; close the connection after a window that sent fewer than
        ``min_send_rate_bytes_per_s * write_timeout_s`` bytes (none: ``stalled``, too few: ``slow``)."""
        if self._write_watch is not None or self.transport is None:
            return
        self._window_sent = self._written - self.transport.get_write_buffer_size()
        self._window_start_s = self._now_s()
        self._write_watch = asyncio.get_running_loop().call_later(self.book.write_timeout_s / 4, self._look_at_writes)

    def _look_at_writes(self) -> None:
        """One look, also while the HTTP server closes the connection."""
        self._write_watch = None
        if self.transport is None or self._lost:
            return
        pending = self.transport.get_write_buffer_size()
        if not pending:
            return
        if self._now_s() - self._window_start_s >= self.book.write_timeout_s:
            left = self._written - pending - self._window_sent
            if not left or left < self.book.min_send_rate_bytes_per_s * self.book.write_timeout_s:
                if left:
                    self.book.slow += 1
                else:
                    self.book.stalled += 1
                self.abort(reset=True)
                return
            self._window_sent, self._window_start_s = self._written - pending, self._now_s()
        self._write_watch = asyncio.get_running_loop().call_later(self.book.write_timeout_s / 4, self._look_at_writes)

    def sending(self) -> bool:
        """Part of a response is still in the transport's write buffer (such a connection is
        not idle: only the write watch may close it)."""
        return self.transport is not None and bool(self.transport.get_write_buffer_size())

    @staticmethod
    def _now_s() -> float:
        return asyncio.get_running_loop().time()

    def _wait_for_head(self) -> None:
        """From now on a request head must arrive whole within the limits."""
        if self.transport is None or self._lost or self in self.book.waiting:
            return
        self.book.waiting[self] = None
        self._head_bytes, self._tail, self._head_begun = 0, b"", False
        self._deadline = asyncio.get_running_loop().call_later(self.book.head_timeout_s, self._head_overdue)

    def _head_overdue(self) -> None:
        """No whole head in time: closed, unless a response is still leaving (then it waits on, as
        long as the response leaves)."""
        if self.transport is not None and self.transport.get_write_buffer_size():
            self._deadline = asyncio.get_running_loop().call_later(self.book.head_timeout_s, self._head_overdue)
            self._watch_writes()
        else:
            self.abort()

    def data_received(self, data: bytes) -> None:
        """Hand ``data`` to the HTTP parser in pieces of at most ``max_pipelined`` heads' ends each,
        checking the pipeline after each piece: a read of 256 KiB holds 2,000 small requests, which
        the parser would keep; a body's own blank lines may end a piece, never the connection."""
        for piece in _pieces(data, self.book.max_pipelined):
            if not self._take(piece) or self.transport is None or self.transport.is_closing():
                return

    def _take(self, data: bytes) -> bool:
        """Parse ``data`` within the limits; False if that closed the connection."""
        if self in self.book.waiting:
            if not self._watch_head(data):
                return False
            self.inner.data_received(data)
            if not self._pipeline_within_cap():
                return False
            self._note_body()
            return True
        before = getattr(self.inner, "cycle", None)  # the HTTP protocol's latest request (uvicorn's)
        whole_before = before is not None and not getattr(before, "more_body", True)
        self.inner.data_received(data)
        if not self._pipeline_within_cap():
            return False
        self._count_next_head(data, before, whole_before)
        self._note_body()
        return True

    def _pipeline_within_cap(self) -> bool:
        """At most ``max_pipelined`` requests queued behind the one answered; else the connection is reset."""
        if len(getattr(self.inner, "pipeline", ())) <= self.book.max_pipelined:
            return True
        self.book.overpipelined += 1
        self.abort(reset=True)
        return False

    def _note_body(self) -> None:
        """Whether the latest request's body is still due, and since when (its head's arrival, or
        the end of the body before it)."""
        latest = getattr(self.inner, "cycle", None)
        if self._lost or self in self.book.waiting or latest is None or not getattr(latest, "more_body", False):
            self.book.receiving.pop(self, None)
        elif self._body_cycle is not latest:  # a new request's body: the newest
            self.book.receiving.pop(self, None)
            self.book.receiving[self] = self._now_s()
        self._body_cycle = latest

    def _count_next_head(self, data: bytes, before: object, whole_before: bool) -> None:
        """While a request is answered, the bytes after the latest request's whole body are the
        next request's head (pipelined): held to the head's size cap (its time limit starts once
        no answer is pending), or the connection is reset. ``before``: the latest request before
        ``data`` was read, ``whole_before``: its body was in whole."""
        latest = getattr(self.inner, "cycle", None)
        if latest is None or getattr(latest, "more_body", True):
            self._head_bytes = 0  # a body is coming: the route's own cap holds it
            return
        end = data.rfind(HEAD_END)
        if latest is before:  # no new head ended here
            self._head_bytes = self._head_bytes + len(data) if whole_before else 0  # else its body ended here
        elif end >= 0:  # a new head ended here: what follows it and its body
            self._head_bytes = max(0, len(data) - end - len(HEAD_END) - len(getattr(latest, "body", b"")))
        else:
            self._head_bytes = len(data)  # its head ended across reads: counted whole, a read at most over
        if self._head_bytes > self.book.head_max_bytes:
            self.abort(reset=True)

    def _watch_head(self, data: bytes) -> bool:
        """Count ``data`` against the head's limits; False if that closed the connection. Blank
        lines before the request line (which HTTP parsers skip) do not begin a head, so an end of
        head is looked for only after its first other byte: ``\r\n\r\n`` alone is no head."""
        scanned = data
        if not self._head_begun:
            scanned = data.lstrip(b"\r\n")
            self._head_begun = bool(scanned)
        if HEAD_END in scanned or (scanned is data and HEAD_END in self._tail + data[:len(HEAD_END) - 1]):
            self._head_arrived()
            return True
        self._head_bytes += len(data)
        if self._head_bytes > self.book.head_max_bytes:
            self.abort()
            return False
        self._tail = (self._tail + scanned[-(len(HEAD_END) - 1):])[-(len(HEAD_END) - 1):]
        return True

    def _head_arrived(self) -> None:
        self.book.waiting.pop(self, None)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def abort(self, *, reset: bool = False) -> None:
        """Close at once (the descriptor is freed now); the wrapped protocol hears connection_lost.
        With ``reset`` the kernel also drops the bytes it has not sent yet and resets the connection."""
        if self.transport is None or self._lost:
            return
        if reset:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._head_arrived()
        if self._write_watch is not None:
            self._write_watch.cancel()
            self._write_watch = None
        self.book.forget(self)
        if self.transport is not None:
            self.inner.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.transport is not None else None

    def pause_writing(self) -> None:
        self._watch_writes()
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def guarded(inner_class: Callable[..., asyncio.Protocol], book: ConnectionBook) -> type[GuardedConnection]:
    """A protocol class that runs ``inner_class`` under ``book``'s limits."""
    return type("GuardedHttpConnection", (GuardedConnection,), {"book": book, "inner_class": inner_class})


class _InnerTransport:
    """The transport the wrapped protocol writes to. It calls ``on_write`` with their count just
    before bytes are handed to the transport (which may pause the protocol), and holds a response
    head (bytes ending in a blank line) back until the next write, its body, so that both leave in
    one ``writev``: one TCP segment and one wake-up of the client for a small answer, where an
    HTTP server that writes head and body apart would cost two. A head with no body follows at
    the end of the loop turn. Bytes written once the connection is closing are dropped.
    Everything else is the wrapped transport's."""

    __slots__ = ("_head", "_loop", "_on_write", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 on_write: Callable[[int, bytes], None]) -> None:
        self._transport = transport
        self._loop = loop
        self._on_write = on_write
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        head, self._head = self._head, None
        if self._transport.is_closing():
            return  # closed under the app (a request pipelined behind the one that was answering)
        if head is not None:
            self._on_write(len(head) + len(data), head)
            self._transport.writelines([head, data])
        elif data.endswith(HEAD_END):  # a head (or a body that ends like one: it leaves a turn later)
            self._head = data
            self._loop.call_soon(self._flush)
        else:
            self._on_write(len(data), data)
            self._transport.write(data)

    def writelines(self, parts: Any) -> None:
        head, self._head = self._head, None
        if self._transport.is_closing():
            return
        parts = [head, *parts] if head is not None else list(parts)
        self._on_write(sum(len(part) for part in parts), parts[0] if parts else b"")
        self._transport.writelines(parts)

    def _flush(self) -> None:
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._on_write(len(head), head)
            self._transport.write(head)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
