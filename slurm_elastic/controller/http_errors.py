"""The API's error answers that FastAPI's defaults get wrong: a refused body whose value JSON has
no text for, and a store or state file that failed under a request."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from fastapi import Request, Response, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError

from slurm_elastic.rollouts.storage import StoreUnavailableError

STORE_RETRY_AFTER_S = 2  # a request the store failed: try again after this long
log = logging.getLogger(__name__)


async def invalid_request(_request: Request, exc: Exception) -> Response:
    """422 naming each refused field, as FastAPI answers, in an answer that can always be written:
    the refused input may be a value JSON has no text for (``NaN`` and ``Infinity``, which
    Python's JSON parser takes from a body, or a lone surrogate), shown as text instead."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    body = json.dumps({"detail": json_safe(jsonable_encoder(errors))}, ensure_ascii=True)
    return Response(body, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT, media_type="application/json")


def json_safe(value: Any) -> Any:
    """``value`` with every number that is not finite replaced by its text (``"nan"``, ``"inf"``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


async def storage_failed(_request: Request, exc: Exception) -> Response:
    """A route whose store or state file failed: 503 with Retry-After (the request changed nothing)."""
    log.warning("storage failed under a request: %s", exc)
    return Response(json.dumps({"detail": f"storage failed: {exc}"}), status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
                    media_type="application/json", headers={"Retry-After": retry_after(exc)})


def retry_after(exc: BaseException) -> str:
    """Seconds a client waits before trying again after a storage failure: the store's own hint
    (:class:`StoreUnavailableError`), else ``STORE_RETRY_AFTER_S``."""
    hint = exc.retry_after_s if isinstance(exc, StoreUnavailableError) else STORE_RETRY_AFTER_S
    return str(max(1, round(hint)))
