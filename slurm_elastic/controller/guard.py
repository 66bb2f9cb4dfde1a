"""What every request to the controller passes before anything reads its body: the job's token
(401 without one, 403 with a wrong one), then the body's size (413 over the route's cap, from
``Content-Length`` before a byte is read, or counted as a chunked body streams in).

One check in the ASGI layer, in front of routing (:class:`~slurm_elastic.controller.rollout_http.ControllerApp`
calls it), so that no route can parse a body first. A refusal closes the connection: the
server does not read the rest of a body it refused.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import Message, Receive, Scope, Send

Headers = list[tuple[bytes, bytes]]

BODY_MAX_BYTES = 1 << 20  # every route but the rollout submit
SUBMIT_PATH = "/rollouts"


def refusal(status_code: int, detail: str, headers: Headers | None = None) -> tuple[int, bytes, Headers]:
    """An answer shaped like FastAPI's errors (``{"detail": ...}``) that closes the connection."""
    return status_code, json.dumps({"detail": detail}).encode(), [
        (b"content-type", b"application/json"), (b"connection", b"close"), *(headers or [])]


async def send_answer(send: Send, answer: tuple[int, bytes, Headers]) -> None:
    code, body, headers = answer
    await send({"type": "http.response.start", "status": code,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """The token and body-size checks for one job's API."""

    def __init__(self, token: str, submit_max_bytes: int, body_max_bytes: int = BODY_MAX_BYTES) -> None:
        self.token = token.encode()
        self.submit_max_bytes = submit_max_bytes
        self.body_max_bytes = body_max_bytes

    def limit_bytes(self, scope: Scope) -> int:
        return self.submit_max_bytes if scope["path"] == SUBMIT_PATH else self.body_max_bytes

    def check(self, scope: Scope) -> tuple[tuple[int, bytes, Headers] | None, bool]:
        """(the refusal, or None; whether the body must be counted as it arrives: chunked)."""
        authorization = content_length = b""
        chunked = False
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"content-length":
                content_length = value
            elif name == b"transfer-encoding":
                chunked = True
        scheme, _, token = authorization.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return refusal(401, "missing bearer token", [(b"www-authenticate", b"Bearer")]), False
        if not hmac.compare_digest(token, self.token):
            return refusal(403, "wrong token for this job"), False
        limit = self.limit_bytes(scope)
        if content_length and (not content_length.isdigit() or int(content_length) > limit):
            return self.too_big(limit), False
        return None, chunked  # with a Content-Length within the cap, the server reads no more than it says

    @staticmethod
    def too_big(limit: int) -> tuple[int, bytes, Headers]:
        return refusal(413, f"request body over {limit} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> tuple[Receive, Send] | None:
        """Refuse the request (answered here, None returned), or the ``receive`` and ``send`` to
        serve it with: a chunked body is counted as it streams in and refused past the cap."""
        answer, count = self.check(scope)
        if answer is not None:
            await send_answer(send, answer)
            return None
        if not count:
            return receive, send
        capped = _CappedBody(receive, send, self.limit_bytes(scope))
        return capped.receive, capped.send


class _CappedBody:
    """``receive`` counting the body: past ``limit`` bytes it answers 413 itself, tells the app the
    client went away, and drops what the app sends after that."""

    __slots__ = ("_receive", "_send", "limit", "received", "refused")

    def __init__(self, receive: Receive, send: Send, limit: int) -> None:
        self._receive, self._send, self.limit = receive, send, limit
        self.received = 0
        self.refused = False

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.refused = True
                await send_answer(self._send, RequestGuard.too_big(self.limit))
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if not self.refused:
            await self._send(message)
