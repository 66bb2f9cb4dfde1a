"""A worker step's two calls to its controller, register and heartbeat, over ``http.client``.

The step wrapper starts with every worker launch and makes only these calls, so it uses the
standard library's HTTP client (a few ms to import) rather than httpx (about 100 ms with its
dependencies). Errors map as :class:`~slurm_elastic.client.control.ControlClient`'s do: no answer
is :class:`ControllerUnreachableError`, a 404 :class:`UnknownOnControllerError`, any other error
status :class:`ApiError`, and an answer no controller gives (a 2xx that is not a JSON object, a
redirect, a head ``http.client`` cannot read, a body over ``ANSWER_MAX_BYTES``, or one still
arriving past :func:`~slurm_elastic.client.answers.answer_deadline_s` after its head)
:class:`ControllerAnswerError`, a :class:`ControllerUnreachableError`.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from slurm_elastic.client import answers
from slurm_elastic.errors import (
    ApiError,
    ConfigError,
    ControllerAnswerError,
    ControllerUnreachableError,
    UnknownOnControllerError,
)

READ_BYTES = 1 << 16


class StepControlClient:
    """register/heartbeat at ``url`` with the job's bearer token, on one kept-alive connection."""

    def __init__(self, url: str, token: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"not an http(s) URL of a controller: {url!r}")
        self._scheme, self._host, self._port = parts.scheme, parts.hostname, parts.port
        self._prefix = parts.path
        self._timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def register(self, worker_id: str, info: dict[str, Any]) -> dict[str, Any]:
        return self._post(f"/workers/{worker_id}/register", info)

    def heartbeat(self, worker_id: str, info: dict[str, Any]) -> dict[str, Any]:
        return self._post(f"/workers/{worker_id}/heartbeat", info)

    def _connect(self) -> http.client.HTTPConnection:
        if self._scheme == "https":
            return http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout_s)
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body, separators=(",", ":")).encode()
        for attempt in range(2):  # a kept-alive connection the server has closed meanwhile: once more, fresh
            reused = self._conn is not None
            conn = self._conn or self._connect()
            try:
                conn.request("POST", self._prefix + path, body=data, headers=self._headers)
                sock = conn.sock  # the response's too, after a close of the connection
                response = conn.getresponse()
                status, payload = response.status, self._read(response, sock, path)
            except (OSError, http.client.HTTPException, ControllerAnswerError) as exc:
                conn.close()
                self._conn = None
                if reused and attempt == 0 and isinstance(exc, ConnectionError):
                    continue
                if not _no_answer(exc):
                    raise _not_the_controllers(exc, self.url, path) from None
                raise ControllerUnreachableError(f"controller at {self.url} did not answer: {exc}") from None
            self._conn = None if response.will_close else conn
            if 300 <= status < 400:
                raise ControllerAnswerError(f"the server at {self.url} answered POST {path} with {status} (to "
                                            f"{response.getheader('location', 'nowhere')!r}): the controller "
                                            "never redirects")
            return _answer(status, payload, f"the server at {self.url} answered POST {path}")
        raise AssertionError("unreachable")  # pragma: no cover

    def _read(self, response: http.client.HTTPResponse, sock: socket.socket | None, path: str) -> bytes:
        """The body: at most ``ANSWER_MAX_BYTES``, arriving within ``answer_deadline_s`` of its
        head (each read waits only what is left of that), else :class:`ControllerAnswerError`."""
        started_s, size = time.monotonic(), 0
        chunks: list[bytes] = []
        try:
            while True:
                left_s = answers.answer_deadline_s(self._timeout_s, size) - (time.monotonic() - started_s)
                try:
                    if left_s <= 0:
                        raise TimeoutError
                    if sock is not None and sock.fileno() >= 0:  # Python 3.12+ closes it with a run-out length
                        sock.settimeout(left_s)
                    chunk = response.read1(READ_BYTES)
                except TimeoutError:
                    raise ControllerAnswerError(
                        f"the server at {self.url} was still sending its answer to POST {path} "
                        f"{time.monotonic() - started_s:.0f} s after it began ({size} bytes so far)") from None
                if not chunk:
                    response.close()  # read whole (a length run out is not closed by read1): the connection goes on
                    return b"".join(chunks)
                size += len(chunk)
                chunks.append(chunk)
                if size > answers.ANSWER_MAX_BYTES:
                    raise ControllerAnswerError(f"the server at {self.url} answered POST {path} with more than "
                                                f"{answers.ANSWER_MAX_BYTES} bytes: not the controller's answer")
        finally:
            if sock is not None and sock.fileno() >= 0:  # closed with the response when the server closes
                sock.settimeout(self._timeout_s)  # for the next call on a kept-alive connection


def _no_answer(exc: BaseException) -> bool:
    """An error that says nothing came back (refused, reset, timed out, cut short), not a wrong answer."""
    return isinstance(exc, (OSError, http.client.IncompleteRead, http.client.ImproperConnectionState))


def _not_the_controllers(exc: BaseException, url: str, path: str) -> ControllerAnswerError:
    if isinstance(exc, ControllerAnswerError):
        return exc
    return ControllerAnswerError(f"the server at {url} answered POST {path} with what is not the controller's "
                                 f"answer: {exc!r}"[:500])


def _answer(status: int, payload: bytes, who: str) -> dict[str, Any]:
    """The JSON object of a 2xx answer (:class:`ControllerAnswerError` for anything else there);
    the matching error for an error status."""
    try:
        body: Any = json.loads(payload) if payload else None
    except ValueError:
        body = None
    if status == 404:
        raise UnknownOnControllerError(_detail(body, payload))
    if status >= 400:
        raise ApiError(status, _detail(body, payload))
    if not isinstance(body, dict):
        raise ControllerAnswerError(f"{who} with {status} and not a JSON object: "
                                    f"{payload[:200].decode(errors='replace')!r}")
    return body


def _detail(body: Any, payload: bytes) -> str:
    if body is None:
        return payload[:300].decode(errors="replace")
    detail = body.get("detail", body) if isinstance(body, dict) else body
    return str(detail)[:500]
