"""What every request to the controller passes before anything reads its body: one
``Authorization`` header (400 with more than one: which of them counts is not the client's to
choose), one ``Host`` header on an HTTP/1.1 request (400 without one or with more than one, as
RFC 9112 section 3.2 requires; every client of the controller sends it: httpx, ``http.client``,
curl), the job's token (401 without one, 403 with a wrong one), a path of printable characters
(404 otherwise: Starlette's routes, ending in ``$``, would take ``/admin/scale`` followed by a
newline) with no encoded ``/`` (404: the server decodes ``/admin%2Fpause`` to ``/admin/pause``), no query parameter named twice
(400: ``?version=1&version=2``; which counts is not the client's to choose), no body
on a request that asks to switch protocols (400: ``Connection: Upgrade`` with ``Upgrade: h2c``,
as ``curl --http2`` sends; the HTTP parser stops at such a head and the body never reaches the
route, which would answer as if none was sent; without a body the request is answered as plain
HTTP/1.1, and the connection closed after the answer: the parser reads nothing sent behind such
a head, so a request pipelined behind it would never be answered), then the body's size (413 over the route's cap, from ``Content-Length`` before a byte
is read, or counted as a chunked body streams in), then the body's time: it must arrive whole
within ``body_timeout_s`` of its head (408 otherwise), so a client that trickles a body, or
declares more than it sends, holds its connection that long at most.

The two header counts come before the token: like the malformed heads the HTTP parser answers
400 before any check of ours, they are faults of the message's framing, found in the head that
has been read whole; refusing them reads no body, reaches no route and says nothing of the job.
The token is then checked before any other part of the request is looked at.

One check in the ASGI layer, in front of routing (:class:`~slurm_elastic.controller.rollout_http.ControllerApp`
calls it), so that no route can parse a body first. A refusal closes the connection: the
server does not read the rest of a body it refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from urllib.parse import parse_qsl

from starlette.types import Message, Receive, Scope, Send

Headers = list[tuple[bytes, bytes]]

BODY_MAX_BYTES = 1 << 20  # every route but the rollout submit
SUBMIT_PATH = "/rollouts"
BODY_TIMEOUT_S = 30.0  # a request body must arrive whole within this long of its head


def refusal(status_code: int, detail: str, headers: Headers | None = None) -> tuple[int, bytes, Headers]:
    """An answer shaped like FastAPI's errors (``{"detail": ...}``) that closes the connection."""
    return status_code, json.dumps({"detail": detail}).encode(), [
        (b"content-type", b"application/json"), (b"connection", b"close"), *(headers or [])]


async def send_answer(send: Send, answer: tuple[int, bytes, Headers]) -> None:
    code, body, headers = answer
    await send({"type": "http.response.start", "status": code,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def repeated_query_name(query: bytes) -> str | None:
    """The first name given twice in a query string (``?version=1&version=2``), None if none is."""
    if not query:
        return None
    seen: set[str] = set()
    for name, _value in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
        if name in seen:
            return name
        seen.add(name)
    return None


class RequestGuard:
    """The token and body-size checks for one job's API."""

    def __init__(self, token: str | tuple[str, ...], submit_max_bytes: int, body_max_bytes: int = BODY_MAX_BYTES,
                 body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.tokens = tuple(t.encode() for t in ((token,) if isinstance(token, str) else token))
        self.submit_max_bytes = submit_max_bytes
        self.body_max_bytes = body_max_bytes
        self.body_timeout_s = body_timeout_s

    def limit_bytes(self, scope: Scope) -> int:
        """The body cap: the submit's for ``POST /rollouts``, the control routes' for any other
        request (another method on that path is answered 405, and must not bring 32 MiB first)."""
        submit = scope["path"] == SUBMIT_PATH and scope["method"] == "POST"
        return self.submit_max_bytes if submit else self.body_max_bytes

    def check(self, scope: Scope) -> tuple[tuple[int, bytes, Headers] | None, bool, bool, bool]:
        """(the refusal, or None; whether a body follows; whether it must be counted as it
        arrives: chunked; whether the connection closes after the answer: an Upgrade request)."""
        authorization = content_length = b""
        chunked = False
        authorizations = hosts = 0
        upgrade = connection_upgrade = False
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
                authorizations += 1
            elif name == b"host":
                hosts += 1
            elif name == b"content-length":
                content_length = value.strip(b" \t")  # HTTP allows whitespace around a field's value
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"upgrade":
                upgrade = True
            elif name == b"connection":
                connection_upgrade = connection_upgrade or b"upgrade" in (
                    option.strip(b" \t").lower() for option in value.split(b","))
        if authorizations > 1:
            return refusal(400, "more than one Authorization header"), False, False, True
        if hosts > 1 or (hosts == 0 and scope.get("http_version") == "1.1"):
            return refusal(400, "an HTTP/1.1 request needs exactly one Host header (RFC 9112 section 3.2); "
                                f"this one has {hosts}"), False, False, True
        scheme, _, token = authorization.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return refusal(401, "missing bearer token", [(b"www-authenticate", b"Bearer")]), False, False, True
        if not any([hmac.compare_digest(token, accepted) for accepted in self.tokens]):  # each compared
            return refusal(403, "wrong token for this job"), False, False, True
        if not scope["path"].isprintable():  # the router's `$` would take a trailing newline
            return refusal(404, "no route: the path holds a control character"), False, False, True
        if b"%2f" in scope.get("raw_path", b"").lower():  # decoded, it would route as a separator
            return refusal(404, "no route: the path holds an encoded / (%2F)"), False, False, True
        if (twice := repeated_query_name(scope.get("query_string", b""))) is not None:
            return refusal(400, f"query parameter {twice!r} given more than once: which of them counts is not "
                                "the client's to choose"), False, False, True
        limit = self.limit_bytes(scope)
        if content_length and not content_length.isdigit():
            return refusal(400, "Content-Length is not a whole number of bytes"), False, False, True
        has_body = chunked or content_length.strip(b"0") != b""
        if upgrade and connection_upgrade and has_body:
            return refusal(400, "the request asks to switch protocols (Upgrade), which this server does not: its "
                                "body would be lost; send it as plain HTTP/1.1 (curl: --http1.1)"), False, False, True
        if content_length and int(content_length) > limit:
            return self.too_big(limit), False, False, True
        # with a Content-Length within the cap, the server reads no more than it says
        return None, has_body, chunked, upgrade and connection_upgrade

    @staticmethod
    def too_big(limit: int) -> tuple[int, bytes, Headers]:
        return refusal(413, f"request body over {limit} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> tuple[Receive, Send] | None:
        """Refuse the request (answered here, None returned), or the ``receive`` and ``send`` to
        serve it with: a body is timed, a chunked one also counted as it streams in and
        refused past the cap."""
        answer, has_body, count, close = self.check(scope)
        if answer is not None:
            await send_answer(send, answer)
            return None
        if close:
            send = closing(send)
        if not has_body:
            return receive, send
        body = _WatchedBody(receive, send, self.limit_bytes(scope) if count else None, self.body_timeout_s)
        return body.receive, body.send


def closing(send: Send) -> Send:
    """``send`` with ``Connection: close`` added to the answer's head."""
    async def with_close(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        await send(message)
    return with_close


class _WatchedBody:
    """``receive`` timing the body, and counting it with a ``limit``: a body still incomplete
    ``timeout_s`` after the app first asked for it (at once, for every route that takes a body;
    a route that takes none answers without it) unless the app has begun its answer gets 408,
    one past ``limit`` bytes 413, answered here; once that answer has left, the app is told the
    client went away, and what it sends after that is dropped. The answer closes the connection."""

    __slots__ = ("_receive", "_send", "_timer", "answering", "asked", "limit", "received", "refused", "timeout_s")

    def __init__(self, receive: Receive, send: Send, limit: int | None, timeout_s: float) -> None:
        self._receive, self._send, self.limit, self.timeout_s = receive, send, limit, timeout_s
        self.received = 0
        self.refused = self.asked = False
        self.answering: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def _overdue(self) -> None:
        self._timer = None
        self._refuse(refusal(408, f"request body not received whole within {self.timeout_s:g} s"))

    def _refuse(self, answer: tuple[int, bytes, Headers]) -> asyncio.Task[None]:
        """Answer now; a ``receive`` the app is waiting in ends as the answer leaves."""
        self.refused = True
        self._stop_timer()
        self.answering = asyncio.get_running_loop().create_task(send_answer(self._send, answer))
        return self.answering

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _disconnected(self) -> Message:
        """The app hears that the client went away only once the refusal has left: an app that
        returned first would have the server answer 500 instead (seen under load)."""
        if self.answering is not None:
            with contextlib.suppress(Exception):  # a client already gone: nothing to tell it
                await self.answering
        return {"type": "http.disconnect"}

    async def receive(self) -> Message:
        if self.refused:
            return await self._disconnected()
        if not self.asked:
            self.asked = True
            self._timer = asyncio.get_running_loop().call_later(self.timeout_s, self._overdue)
        message = await self._receive()
        if self.refused:
            return await self._disconnected()
        if message["type"] != "http.request":
            self._stop_timer()
            return message
        if self.limit is not None:
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                await self._refuse(RequestGuard.too_big(self.limit))
                return {"type": "http.disconnect"}
        if not message.get("more_body"):
            self._stop_timer()
        return message

    async def send(self, message: Message) -> None:
        if not self.refused:
            self.asked = True  # the app answers: the body is no longer waited for
            self._stop_timer()
            await self._send(message)
