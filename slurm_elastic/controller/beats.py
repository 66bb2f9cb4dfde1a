"""``POST /workers/{worker_id}/heartbeat`` and ``POST /agent/report`` answered in front of the
framework when they can be at once.

Every worker heart-beats every few seconds and every node agent reports as often, so at hundreds
of workers these are the controller's most frequent requests. :class:`ControllerApp` hands them
here after the token and size checks; a body that validates (the route's own model) for a known
worker or a node of the job, while the controller's lock is free, is answered on the event loop
without FastAPI's routing and thread pool hop (an agent report: 2.6 -> 1.2 ms of CPU,
``bench/bench_heartbeat_cost.py``). Anything else (a body that does not validate, an unknown worker or node, the lock held
by a tick) goes to the FastAPI route with the body replayed, which answers as it always does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from starlette.types import Message, Receive, Scope

from slurm_elastic.client.wire import WORKER_ID, AgentReportBody, Heartbeat
from slurm_elastic.controller.guard import Headers
from slurm_elastic.controller.runtime import Controller, UnknownWorkerError

_PATH = re.compile("/workers/(" + WORKER_ID.strip("^$") + ")/heartbeat")  # whole paths only (fullmatch)
_JSON: Headers = [(b"content-type", b"application/json")]


class HeartbeatEndpoint:
    """The heartbeat route's fast path for ``controller``."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    @staticmethod
    def worker_id(scope: Scope) -> str | None:
        """The worker id of a heartbeat request, or None for any other request."""
        if scope["method"] != "POST":
            return None
        match = _PATH.fullmatch(scope["path"])
        return match.group(1) if match else None

    def answer(self, worker_id: str, body: bytes) -> tuple[int, bytes, Headers] | None:
        """The answer when it can be given at once; None: let the FastAPI route answer."""
        try:
            beat = Heartbeat.model_validate_json(body)
        except ValidationError:
            return None
        return answered_at_once(self.controller, lambda: self.controller.heartbeat(
            worker_id, beat.model_dump(exclude_none=True)))


class AgentReportEndpoint:
    """The agent report route's fast path for ``controller``."""

    PATH = "/agent/report"

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    @classmethod
    def matches(cls, scope: Scope) -> bool:
        return bool(scope["method"] == "POST" and scope["path"] == cls.PATH)

    def answer(self, body: bytes) -> tuple[int, bytes, Headers] | None:
        """The answer when it can be given at once; None: let the FastAPI route answer."""
        try:
            report = AgentReportBody.model_validate_json(body)
        except ValidationError:
            return None
        return answered_at_once(self.controller, lambda: self.controller.report_gpu_health(report.to_core()))


def answered_at_once(controller: Controller, call: Callable[[], dict[str, Any]]) -> tuple[int, bytes, Headers] | None:
    """``call()``'s answer, made while the controller's lock is free at once; None when a tick holds
    it (the route waits in a thread, not the loop) or ``call`` names an unknown worker or node."""
    lock = controller.lock
    if not lock.acquire(blocking=False):
        return None
    try:
        reply = call()
    except UnknownWorkerError:
        return None
    finally:
        lock.release()
    return 200, json.dumps(reply, separators=(",", ":")).encode(), _JSON


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client went away first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` once, then whatever the client sends next."""
    pending = [body]

    async def replay() -> Message:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        return await receive()

    return replay
