"""A worker step's two calls to its controller, register and heartbeat, over ``http.client``.

The step wrapper starts with every worker launch and makes only these calls, so it uses the
standard library's HTTP client (a few ms to import) rather than httpx (about 100 ms with its
dependencies). Errors map as :class:`~slurm_elastic.client.control.ControlClient`'s do: no answer
is :class:`ControllerUnreachableError`, a 404 :class:`UnknownOnControllerError`, any other error
status :class:`ApiError`.
"""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit

from slurm_elastic.errors import (
    ApiError,
    ConfigError,
    ControllerUnreachableError,
    UnknownOnControllerError,
)


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
                response = conn.getresponse()
                status, payload = response.status, response.read()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                self._conn = None
                if reused and attempt == 0 and isinstance(exc, ConnectionError):
                    continue
                raise ControllerUnreachableError(f"controller at {self.url} did not answer: {exc}") from None
            self._conn = None if response.will_close else conn
            return _answer(status, payload)
        raise AssertionError("unreachable")  # pragma: no cover


def _answer(status: int, payload: bytes) -> dict[str, Any]:
    """The JSON object of a 2xx answer; the matching error for any other status."""
    try:
        body: Any = json.loads(payload) if payload else {}
    except ValueError:
        body = None
    if status == 404:
        raise UnknownOnControllerError(_detail(body, payload))
    if status >= 400:
        raise ApiError(status, _detail(body, payload))
    if body is None:
        raise ApiError(status, f"not JSON: {payload[:300].decode(errors='replace')}")
    return body if isinstance(body, dict) else {"result": body}


def _detail(body: Any, payload: bytes) -> str:
    if body is None:
        return payload[:300].decode(errors="replace")
    detail = body.get("detail", body) if isinstance(body, dict) else body
    return str(detail)[:500]
