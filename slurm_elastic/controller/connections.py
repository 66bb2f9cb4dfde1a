"""Limits on the API's connections, below the HTTP server: how many may be open, and how long
and how large a request head may be.

A connection waiting for a request head must deliver the whole head within ``head_timeout_s``
(of opening; after a response, of the head's first byte, which may come until ``idle_s``, the
keep-alive time), or it is closed: a client that sends a head a byte at a time, or never sends
one, holds no descriptor for long. A request answered before its body came (a 404 for a POST)
closes its connection after the answer: what the client sends next is that body. A head is at most ``head_max_bytes``,
counted here from the bytes of a head not ended yet, or of one that ends in the read (the first
on a connection, or the next after an answer), and by the HTTP parser for any head it reads
(:func:`~slurm_elastic.controller.framing.framed`): one over it, whatever the reads, is parsed
no further; the answers due before it go out, then ``431 Request Header Fields Too Large``, and
the connection closes (what the client still sends is read and dropped for ``LINGER_S`` at
most, so that the answer is not lost to a reset). At most
``max_connections`` are open; one more closes the longest-waiting connection that has no request
in progress and no response still leaving, else the one whose request body began arriving the
longest ago, if ``slow_body_s`` or more ago (a client that sends a head and then its body a byte
at a time, at whatever pace, holds no slot for long: a body takes milliseconds to arrive), or is
itself closed at once if every connection is busy.
An interim answer (``100 Continue``) is no response: the request's body follows it. The cap is
kept below the process's open-files limit so that the controller's own files always open
(:mod:`slurm_elastic.controller.open_files`). A response whose bytes
wait in the transport's write buffer must send at least ``min_send_rate_bytes_per_s`` times
``write_timeout_s`` of them in every window of ``write_timeout_s``, or its connection is closed:
a client that never reads its answers (nothing leaves: ``stalled``), or reads them a drip at a
time (``slow``), holds no slot of the cap, and no response in memory, for long; this holds too
once the HTTP server has begun to close the connection (its keep-alive time is up), a close that
waits for the write buffer to empty. Such a connection is reset (``SO_LINGER`` of 0): the kernel
drops what it still holds of the response instead of trying to deliver it for minutes. A
response that fits in the kernel's buffers never waits in the transport's, and is never timed.

:func:`guarded` wraps any asyncio protocol class (uvicorn's ``http=`` setting takes one); it
sees the asyncio ``Protocol`` and ``Transport`` interfaces, two attributes of uvicorn's protocol,
``pipeline`` (the requests that arrived behind the one being answered) and ``cycle`` (the latest
request; ``more_body`` false once its whole body is in, ``response_complete`` once answered),
and two of :func:`~slurm_elastic.controller.framing.framed`'s, ``head_too_large`` and
``client_done``. Bytes after the latest whole request are the next request's head, held to the
head's size cap even while an answer is pending; at most ``max_pipelined`` whole requests may
wait behind the one being answered (each holds its parsed head in memory), or the connection is
reset. A client that shuts its sending side (a half-close; a client that closed its socket shows
the same) with a whole request's answer due gets that answer and those queued behind it, then
the connection closes, and ``client_done`` is set (a long-poll, which waits for its client to
leave, ends); otherwise the connection closes at once, as when the client leaves. The transport
it hands the wrapped protocol sends a response's head together with its body
(:class:`~slurm_elastic.controller.inner_transport.InnerTransport`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from slurm_elastic.controller.framing import HEAD_MAX_BYTES, head_too_large
from slurm_elastic.controller.inner_transport import InnerTransport

HEAD_END = b"\r\n\r\n"
INTERIM = re.compile(rb"HTTP/1\.[01] 1[0-9][0-9] [^\r\n]*\r\n\r\n\Z")  # an interim answer, written whole
SLOW_BODY_S = 1.0  # a request body still arriving this long after it began may be closed to make room
MAX_PIPELINED = 32  # requests queued behind the one being answered; one more resets the connection
LINGER_S = 2.0  # after a 431, what the client still sends is read and dropped this long at most
LINGER_MAX_BYTES = 1 << 20  # ... and this much at most


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


@dataclass
class ConnectionBook:
    """The open connections of one server; those waiting for a head in the order they started waiting."""

    max_connections: int
    head_timeout_s: float
    head_max_bytes: int = HEAD_MAX_BYTES
    idle_s: float = 0.0  # after a response, how long the next head may take to begin (the keep-alive time)
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
    head_too_large: int = 0  # connections answered 431 and closed: a head over head_max_bytes

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
        self._idle = False  # waiting after a response: the head's own time starts at its first byte
        self._next_head_begun = False  # a byte of the next head (other than CR or LF) came while answering
        self._written = 0  # bytes handed to the transport
        self._window_sent = 0  # of them, those that had left its write buffer when the window began
        self._window_start_s = 0.0
        self._write_watch: asyncio.TimerHandle | None = None
        self._body_cycle: object = None  # the request whose body arrival is timed
        self._refusing = False  # a head over the cap: nothing more is parsed; 431 once no answer is due
        self._client_done = False  # the client shut its side with an answer due: closed once it has gone
        self._dropped = 0  # bytes read and dropped since the 431

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        if not self.book.admit(self):
            transport.abort()
            return
        self.transport = transport
        self._wait_for_head()
        inner_transport = InnerTransport(transport, asyncio.get_running_loop(), self._wrote)
        self.inner.connection_made(cast(asyncio.Transport, inner_transport))

    def _wrote(self, nbytes: int, first: bytes) -> None:
        """A response is going out (``first``: its first bytes written now): the connection waits
        for its next request head, unless that head came in already (a request pipelined behind
        this one, queued in the HTTP protocol) or this is an interim answer (``100 Continue``: the
        request's body comes next)."""
        self._written += nbytes
        interim = INTERIM.match(first)
        if not (interim or getattr(self.inner, "pipeline", None)):
            self._wait_for_head(idle=True)
        body_unread = not interim and getattr(getattr(self.inner, "cycle", None), "more_body", False)
        if self._refusing or self._client_done or body_unread:  # answered before its body came: closed after it
            asyncio.get_running_loop().call_soon(self._settle)

    def _answer_due(self) -> bool:
        """A request has been read whose answer has not gone out whole."""
        cycle = getattr(self.inner, "cycle", None)
        return bool(getattr(self.inner, "pipeline", None)) or (
            cycle is not None and not getattr(cycle, "response_complete", True))

    def _settle(self) -> None:
        """Once no answer is due: a refused head gets its 431 (then the connection closes, at once
        if the client has shut its side, else after LINGER_S), and a client that shut its side has
        its connection closed."""
        if self.transport is None or self._lost or self.transport.is_closing() or self._answer_due():
            return
        if self._refusing:
            self.transport.write(head_too_large(self.book.head_max_bytes))
            if not self._client_done and self.transport.can_write_eof():
                self.transport.write_eof()  # the answer, then our end of the stream; reads go on, dropped
                asyncio.get_running_loop().call_later(LINGER_S, self._close)
                return
        self._close()

    def _close(self) -> None:
        """Close once what is buffered has gone; the write watch times that (a client that reads
        nothing would hold the connection, unevictable, for good)."""
        if self.transport is None or self._lost:
            return
        self.transport.close()
        if self.sending():
            self._watch_writes()

    def _refuse_head(self) -> None:
        """A head over the cap: nothing more is parsed or timed as a head; 431 once no answer is due."""
        if not self._refusing:
            self._refusing = True
            self.book.head_too_large += 1
            self._head_arrived()
            self._settle()

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

    def _wait_for_head(self, idle: bool = False) -> None:
        """From now on a request head must arrive whole within the limits; ``idle``, after a
        response: it may begin up to ``book.idle_s`` from now, and must end within the head
        timeout of its first byte (a kept-alive client calling every 15 s finds its connection)."""
        if self.transport is None or self._lost or self in self.book.waiting:
            return
        self.book.waiting[self] = None
        self._head_bytes, self._tail, self._head_begun = 0, b"", False
        self._idle = idle and not self._next_head_begun and self.book.idle_s > self.book.head_timeout_s
        self._next_head_begun = False
        wait_s = self.book.idle_s if self._idle else self.book.head_timeout_s
        self._deadline = asyncio.get_running_loop().call_later(wait_s, self._head_overdue)

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
        the parser would keep; a body's own blank lines may end a piece, never the connection.
        After a refused head, what comes is dropped (and the connection closed past LINGER_MAX_BYTES)."""
        if self._refusing:
            self._dropped += len(data)
            if self._dropped > LINGER_MAX_BYTES:
                self._close()
            return
        for piece in _pieces(data, self.book.max_pipelined):
            if not self._take(piece) or self.transport is None or self.transport.is_closing():
                return

    def _take(self, data: bytes) -> bool:
        """Parse ``data`` within the limits; False if that closed the connection."""
        if self._refusing:
            return False
        if self in self.book.waiting:
            if not self._watch_head(data):
                return False
            self.inner.data_received(data)
            if not self._parsed():
                return False
            self._note_body()
            return True
        before = getattr(self.inner, "cycle", None)  # the HTTP protocol's latest request (uvicorn's)
        whole_before = before is not None and not getattr(before, "more_body", True)
        self.inner.data_received(data)
        if not self._parsed():
            return False
        self._count_next_head(data, before, whole_before)
        if self._refusing:
            return False
        self._note_body()
        return True

    def _parsed(self) -> bool:
        """False if what was parsed refused or closed the connection: a head the parser found over
        the cap (431), or too many requests pipelined (reset)."""
        if getattr(self.inner, "head_too_large", False):
            self._refuse_head()
            return False
        return self._pipeline_within_cap()

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
        no answer is pending), or it is refused (431). ``before``: the latest request before
        ``data`` was read, ``whole_before``: its body was in whole."""
        latest = getattr(self.inner, "cycle", None)
        if latest is None or getattr(latest, "more_body", True):
            self._head_bytes = 0  # a body is coming: the route's own cap holds it
            return
        end = data.rfind(HEAD_END)
        if latest is before:  # no new head ended here
            self._head_bytes = self._head_bytes + len(data) if whole_before else 0  # else its body ended here
            self._next_head_begun = self._next_head_begun or bool(whole_before and data.strip(b"\r\n"))
        elif end >= 0:  # a new head ended here: what follows it and its body
            self._head_bytes = max(0, len(data) - end - len(HEAD_END) - len(getattr(latest, "body", b"")))
            self._next_head_begun = bool(self._head_bytes and data[len(data) - self._head_bytes:].strip(b"\r\n"))
        else:
            self._head_bytes = len(data)  # its head ended across reads: counted whole, a read at most over
            self._next_head_begun = False
        if self._head_bytes > self.book.head_max_bytes:
            self._refuse_head()

    def _watch_head(self, data: bytes) -> bool:
        """Count ``data`` against the head's limits, up to the head's end if it is in ``data``;
        False if the head is refused. Blank lines before the request line (which HTTP parsers
        skip) do not begin a head but count, so an end of head is looked for only after its
        first other byte: ``\r\n\r\n`` alone is no head."""
        scanned = data
        if not self._head_begun:
            scanned = data.lstrip(b"\r\n")
            self._head_begun = bool(scanned)
            if self._head_begun and self._idle and self._deadline is not None:  # the head's own time starts
                self._idle = False
                self._deadline.cancel()
                self._deadline = asyncio.get_running_loop().call_later(self.book.head_timeout_s, self._head_overdue)
        end = scanned.find(HEAD_END)
        if end >= 0:
            end += len(data) - len(scanned) + len(HEAD_END)  # where the head ends in data
        elif scanned is data and (split := (self._tail + data[:len(HEAD_END) - 1]).find(HEAD_END)) >= 0:
            end = split + len(HEAD_END) - len(self._tail)  # an end begun in the read before
        self._head_bytes += len(data) if end < 0 else end
        if self._head_bytes > self.book.head_max_bytes:
            self._refuse_head()
            return False
        if end >= 0:
            self._head_arrived()
            return True
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
        """The client shut its sending side: with a whole request's answer due, the connection
        stays open for it (the protocol's ``client_done`` is set); else it closes."""
        if self.transport is None:
            return None
        self.inner.eof_received()
        latest = getattr(self.inner, "cycle", None)
        if self._lost or not self._answer_due() or getattr(latest, "more_body", True):
            return None  # nothing due, or a body that will not come whole: closed, as when the client leaves
        self._client_done = True
        done = getattr(self.inner, "client_done", None)
        if done is not None:
            done.set()  # a long-poll learns its client is done
        return True

    def pause_writing(self) -> None:
        self._watch_writes()
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def guarded(inner_class: Callable[..., asyncio.Protocol], book: ConnectionBook) -> type[GuardedConnection]:
    """A protocol class that runs ``inner_class`` under ``book``'s limits."""
    return type("GuardedHttpConnection", (GuardedConnection,), {"book": book, "inner_class": inner_class})
