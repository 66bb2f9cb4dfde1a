"""The request body as the FastAPI routes get it, checked once in front of them: JSON nested more
than :data:`JSON_MAX_DEPTH` levels is refused (422, ``json_invalid``) before it is parsed, and the
body is read as JSON whatever its ``Content-Type`` says, and must be UTF-8 (RFC 8259; UTF-16 and
UTF-32, which Python's parser would decode, are refused: the depth check reads UTF-8) (``curl -d`` sends
``application/x-www-form-urlencoded``), as ``POST /rollouts`` and the heartbeat fast path, which
parse the raw bytes, always did.

An ASGI middleware (:class:`JsonBodies`) inside the app, so it runs after the token and size
checks (:class:`~slurm_elastic.controller.guard.RequestGuard`) and only for requests the fast paths
did not answer. The depth check is linear in the body and costs two ``bytes.count`` calls for a
body with no more than :data:`JSON_MAX_DEPTH` brackets (every body a client of ours sends). A body
that is not UTF-8 or holds an integer of more digits than Python converts is refused here (422,
``json_invalid``, saying which), where FastAPI would answer a bare 400; these bodies are small
(control routes), so parsing them once more costs little.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterable
from itertools import accumulate

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from slurm_elastic.controller.beats import read_body, replaying
from slurm_elastic.controller.guard import send_answer

JSON_MAX_DEPTH = 200  # levels of arrays and objects; what the rollout submit's parser (pydantic's) takes
# a string, or an unterminated one up to the end: always matches from its quote, so the scan stays linear
_STRING = re.compile(rb'"(?:[^"\\]++|\\.?)*+(?:"|\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def nested_deeper_than(body: bytes, limit: int = JSON_MAX_DEPTH) -> bool:
    """Whether the JSON text ``body`` nests arrays and objects more than ``limit`` levels deep
    (brackets inside strings do not count). For text that is not JSON, a guess that never
    raises: the parser that follows refuses it anyway."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > limit


def json_invalid(message: str) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """A 422 for a body refused before it is parsed, shaped like the routes' other JSON errors."""
    detail = [{"type": "json_invalid", "loc": ["body"], "msg": message}]
    return 422, json.dumps({"detail": detail}).encode(), [(b"content-type", b"application/json")]


def too_deep_answer(limit: int = JSON_MAX_DEPTH) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """The 422 for a body nested deeper than ``limit``."""
    return json_invalid(f"JSON nested too deeply: more than {limit} levels of arrays and objects")


def unparsable(body: bytes) -> str:
    """Why ``body`` cannot be parsed for a reason FastAPI would answer only with "There was an
    error parsing the body" (bytes that are not UTF-8, an integer longer than Python converts);
    "" otherwise, syntax errors included (FastAPI's own 422 says where they are)."""
    try:
        json.loads(body.decode("utf-8"))  # strict: json.loads(bytes) lets UTF-8-encoded surrogates pass
    except UnicodeDecodeError as exc:
        return f"JSON must be UTF-8: {exc.reason} at byte {exc.start}"
    except json.JSONDecodeError:
        return ""
    except ValueError:  # int(): the digit limit
        return f"a number in the JSON has more than {sys.get_int_max_str_digits()} digits"
    return ""


def _has_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip(b"0 ") != b""):
            return True
    return False


def _as_json(scope: Scope) -> Scope:
    """``scope`` with its ``Content-Type`` replaced by ``application/json``."""
    headers = [(name, value) for name, value in scope["headers"] if name != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


def routed(routes: Callable[[], Iterable[BaseRoute]]) -> Callable[[Scope], bool]:
    """Whether a route of ``routes()`` takes the request: its path and its method."""
    return lambda scope: any(route.matches(scope)[0] is Match.FULL for route in routes())


class JsonBodies:
    """Middleware: every request body, read whole, is refused when nested too deeply, else handed
    on as JSON (its ``Content-Type`` set to ``application/json``). Requests without a body pass
    untouched, and so do those no route takes (``takes``): the framework answers those 404, 405 or
    a redirect without reading their body."""

    def __init__(self, app: ASGIApp, takes: Callable[[Scope], bool] = lambda scope: True,
                 max_depth: int = JSON_MAX_DEPTH) -> None:
        self.app = app
        self.takes = takes
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope) or not self.takes(scope):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:  # the client went away, or the guard refused the body and has answered
            return
        if json.detect_encoding(body) != "utf-8":  # what the depth scan reads; JSON between systems is UTF-8
            await send_answer(send, json_invalid("JSON must be UTF-8 (without a byte order mark)"))
            return
        if nested_deeper_than(body, self.max_depth):
            await send_answer(send, too_deep_answer(self.max_depth))
            return
        refusal = unparsable(body)
        if refusal:
            await send_answer(send, json_invalid(refusal))
            return
        await self.app(_as_json(scope), replaying(body, receive), send)
