"""The transport the HTTP protocol under :class:`~slurm_elastic.controller.connections.GuardedConnection`
writes to (:class:`InnerTransport`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

HEAD_END = b"\r\n\r\n"


class InnerTransport:
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
