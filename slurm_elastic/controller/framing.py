"""What the controller's HTTP server takes of a request's framing, over uvicorn's httptools
protocol (:func:`framed` makes the class uvicorn runs).

- A chunked body's trailer fields are dropped: uvicorn's httptools implementation appends them to
  the request's headers, so a token or any other field sent after the body would count as sent
  before it (RFC 9112 lets a recipient discard them).
- A request head is at most ``head_max_bytes`` as parsed: the target and each header field's
  name and value with their separators, plus the request line's and the head's ends (the spaces
  around a value, which the parser drops, are not counted). One field past it stops the parse
  there, wherever the head's reads ended; the protocol says so (``head_too_large``) instead of
  answering uvicorn's bare 400, and the connection answers :func:`head_too_large` (431)
  (:class:`~slurm_elastic.controller.connections.GuardedConnection`, which also counts the bytes of
  a head that has not ended yet: the parser holds a field whole until it ends).
- Each request's scope carries the connection's :data:`CLIENT_DONE` event in its ``extensions``:
  set once the client has shut its sending side (set by the connection, which still sends the
  answers due), so that a route waiting for its client to leave (a long-poll) ends then too.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

HEAD_MAX_BYTES = 64 * 1024  # a request head: the line and header fields (curl, httpx: well under 1 KiB)
LINE_AND_END_BYTES = len(b"POST  HTTP/1.1\r\n\r\n")  # the request line and the head's end, less the target
CLIENT_DONE = "slurm_elastic.client_done"  # scope["extensions"][CLIENT_DONE]: an asyncio.Event


class HeadTooLarge(Exception):
    """A head past the cap: raised from the parser's callback, which stops the parse."""


def head_too_large(limit: int) -> bytes:
    """The whole 431 answer to a head over ``limit`` bytes; the connection closes after it."""
    body = json.dumps({"detail": f"request head (request line and header fields) over {limit} bytes"}).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


def framed(protocol: type[asyncio.Protocol], head_max_bytes: int = HEAD_MAX_BYTES) -> type[asyncio.Protocol]:
    """``protocol`` (uvicorn's httptools implementation) dropping trailer fields and holding heads
    to ``head_max_bytes``. A field the parser reports once the head is complete (uvicorn has made
    the request's ``cycle`` from this ``scope``) is a trailer's. A protocol without ``on_header``
    is returned as it is."""
    if not callable(getattr(protocol, "on_header", None)):
        return protocol
    base: Any = protocol

    def on_message_begin(self: Any) -> None:
        self.head_bytes = LINE_AND_END_BYTES
        base.on_message_begin(self)
        if self.client_done is None:
            self.client_done = asyncio.Event()
        self.scope["extensions"] = {**self.scope.get("extensions", {}), CLIENT_DONE: self.client_done}

    def on_url(self: Any, url: bytes) -> None:
        count(self, len(url))
        base.on_url(self, url)

    def on_header(self: Any, name: bytes, value: bytes) -> None:
        cycle = getattr(self, "cycle", None)
        if cycle is not None and getattr(cycle, "scope", None) is getattr(self, "scope", None):
            return  # the head is complete: a trailer field
        count(self, len(name) + len(value) + 4)  # ": " and CRLF
        base.on_header(self, name, value)

    def count(self: Any, nbytes: int) -> None:
        self.head_bytes = getattr(self, "head_bytes", LINE_AND_END_BYTES) + nbytes
        if self.head_bytes > head_max_bytes:
            self.head_too_large = True
            raise HeadTooLarge(f"request head over {head_max_bytes} bytes")

    def send_400_response(self: Any, msg: str) -> None:
        if not getattr(self, "head_too_large", False):  # the connection answers a head too large
            base.send_400_response(self, msg)

    return type(f"{protocol.__name__}Framed", (protocol,), {
        "on_message_begin": on_message_begin, "on_url": on_url, "on_header": on_header,
        "send_400_response": send_400_response, "head_too_large": False, "head_max_bytes": head_max_bytes,
        "client_done": None})
