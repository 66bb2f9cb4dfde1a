"""The API's error answers that FastAPI's defaults get wrong: a refused body (its 422 bounded in
size and always writable), and a store or state file that failed under a request."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping
from itertools import islice
from typing import Any

from fastapi import Request, Response, status
from fastapi.exceptions import RequestValidationError

from slurm_elastic.rollouts.storage import StoreUnavailableError

STORE_RETRY_AFTER_S = 2  # a request the store failed: try again after this long
ERRORS_SHOWN = 20  # a 422 lists at most this many errors; "more_errors" counts the rest
TEXT_SHOWN = 200  # characters of a refused string value shown in an error
log = logging.getLogger(__name__)


async def invalid_request(_request: Request, exc: Exception) -> Response:
    """422 naming the refused fields, as FastAPI answers, bounded and always writable: see
    :func:`error_detail`."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    body = json.dumps(error_detail(errors, len(errors)), ensure_ascii=True)
    return Response(body, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT, media_type="application/json")


def error_detail(errors: Iterable[Mapping[str, Any]], count: int, loc_prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """``{"detail": [...]}`` with the first :data:`ERRORS_SHOWN` of ``count`` validation errors
    (pydantic's or FastAPI's dicts, ``loc`` prefixed with ``loc_prefix``), and ``"more_errors"``
    with how many more there were. Each keeps its ``type``, ``loc``, ``msg`` and ``ctx``, and its
    ``input`` only when that is one value (a string cut to :data:`TEXT_SHOWN` characters), not an
    array or object: the answer stays small and flat whatever was sent, and values JSON has no
    text for (``NaN``, ``Infinity``, which Python's JSON parser takes, and lone surrogates) are
    written as text."""
    shown = [_shown(error, loc_prefix) for error in islice(errors, ERRORS_SHOWN)]
    answer: dict[str, Any] = {"detail": shown}
    if count > len(shown):
        answer["more_errors"] = count - len(shown)
    return answer


def _shown(error: Mapping[str, Any], loc_prefix: tuple[str, ...]) -> dict[str, Any]:
    shown: dict[str, Any] = {"type": str(error.get("type", "")), "loc": [*loc_prefix, *map(_loc_part, error.get("loc", ()))],
                             "msg": str(error.get("msg", "")).removeprefix("Value error, ")}  # pydantic's prefix
    value = error.get("input")
    if value is None or isinstance(value, (str, int, float)):  # bool is an int
        shown["input"] = _scalar(value)
    ctx = error.get("ctx")
    if isinstance(ctx, Mapping) and ctx:
        shown["ctx"] = {str(k): _scalar(v) if isinstance(v, (str, int, float)) else _text(str(v)) for k, v in ctx.items()}
    return shown


def _loc_part(part: Any) -> str | int:
    return part if isinstance(part, (int, str)) else str(part)


def _scalar(value: Any) -> Any:
    """``value`` as JSON can write it: a number that is not finite, or a string, as its text."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return _text(value)
    return value


def _text(value: str) -> str:
    """``value``, or its first :data:`TEXT_SHOWN` characters and its length (``json.dumps`` with
    ``ensure_ascii`` writes a lone surrogate as an escape)."""
    return value if len(value) <= TEXT_SHOWN else value[:TEXT_SHOWN] + f"... ({len(value)} characters)"


async def storage_failed(_request: Request, exc: Exception) -> Response:
    """A route whose store or state file failed: 503 with Retry-After (the request changed nothing)."""
    log.warning("storage failed under a request: %s", exc)
    return Response(json.dumps({"detail": f"storage failed: {exc}"}), status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
                    media_type="application/json", headers={"Retry-After": retry_after(exc)})


async def trainer_session_refused(_request: Request, exc: Exception) -> Response:
    """A trainer call with a session older than the newest registration, or one never issued: 409
    (nothing changed)."""
    log.warning("refused a trainer call: %s", exc)
    return Response(json.dumps({"detail": str(exc)}), status_code=status.HTTP_409_CONFLICT,
                    media_type="application/json")


def retry_after(exc: BaseException) -> str:
    """Seconds a client waits before trying again after a storage failure: the store's own hint
    (:class:`StoreUnavailableError`), else ``STORE_RETRY_AFTER_S``."""
    hint = exc.retry_after_s if isinstance(exc, StoreUnavailableError) else STORE_RETRY_AFTER_S
    return str(max(1, round(hint)))
