"""A typed client of the controller's control-plane routes (workers, agents, operators).

Transport errors become :class:`ControllerUnreachableError`; a 404 becomes
:class:`UnknownOnControllerError` (a ``KeyError``: the controller does not know that worker);
any other error status becomes :class:`ApiError` with the controller's message. An answer no
controller gives (a 2xx that is not a JSON object, or one without the keys of the call's answer,
a redirect, a body over :data:`ANSWER_MAX_BYTES`, or one still arriving ``timeout_s`` after its
head: a broken or foreign
server at the controller's address) becomes :class:`ControllerAnswerError`, a
:class:`ControllerUnreachableError`: callers that wait for a restarted controller wait through
it, and a submit is never taken as stored on such an answer.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

import httpx

from slurm_elastic.client.answers import (
    ANSWER_MAX_BYTES,
    answer_deadline_s,
    stored_by_an_earlier_try,
)
from slurm_elastic.errors import (
    ApiError,
    ControllerAnswerError,
    ControllerUnreachableError,
    TrainerSupersededError,
    UnknownOnControllerError,
)

__all__ = ["ControlClient", "UnknownOnControllerError"]

log = logging.getLogger(__name__)
BATCH_MAX_BYTES = 4 << 30  # a batch: batch_size groups, each up to the queue's max_group_bytes
# idle connections are kept this long (httpx's default: 5 s), so a heartbeat every 15 s reuses its own; the
# controller keeps them open past the longest interval it tells (serve.keep_alive_for); one it closed is seen
# closed at the next call and replaced
KEPT_ALIVE = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=120.0)
Shape = dict[str, type | tuple[type, ...] | range]  # keys of an answer: the type(s) of each, or the range of an int


class ControlClient:
    """Calls the controller at ``url`` with the job's bearer token."""

    def __init__(self, url: str, token: str, timeout_s: float = 10.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, transport=transport, limits=KEPT_ALIVE,
                                  headers={"Authorization": f"Bearer {token}"})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _send(self, method: str, path: str, timeout_s: float | None = None, max_bytes: int | None = None,
              **kwargs: Any) -> httpx.Response:
        """The answer, read whole: at most ``max_bytes`` of body, arriving within ``timeout_s``
        (default: the client's) of its head plus a second for each ANSWER_MIN_BYTES_PER_S of it
        (:func:`~slurm_elastic.client.answers.answer_deadline_s`),
        else :class:`ControllerAnswerError` (a server that drips its answer a byte at a time,
        each within the read timeout, is not waited on for ever); httpx's errors as
        :class:`ControllerUnreachableError`."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        max_bytes = ANSWER_MAX_BYTES if max_bytes is None else max_bytes
        try:
            with self._http.stream(method, path, timeout=timeout_s, **kwargs) as response:
                started_s, chunks, size = time.monotonic(), [], 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    chunks.append(chunk)
                    if size > max_bytes:
                        raise ControllerAnswerError(f"the server at {self.url} answered {method} {path} with more "
                                                    f"than {max_bytes} bytes: not the controller's answer")
                    if time.monotonic() - started_s > answer_deadline_s(timeout_s, size):
                        raise ControllerAnswerError(f"the server at {self.url} was still sending its answer to "
                                                    f"{method} {path} {time.monotonic() - started_s:.0f} s after it "
                                                    f"began ({size} bytes so far)")
        except httpx.DecodingError as exc:  # a Content-Encoding its body does not match: no controller's answer
            raise ControllerAnswerError(f"the server at {self.url} answered {method} {path} with a body that "
                                        f"cannot be decoded: {exc}") from None
        except httpx.TransportError as exc:
            sent = method != "GET" and not isinstance(exc, httpx.ConnectError)
            raise ControllerUnreachableError(
                f"controller at {self.url} did not answer: {exc}" + (
                    " (the request may have reached it, and it may still carry it out: `slurm-elastic status` "
                    "says)" if sent else ""), not_connected=isinstance(exc, httpx.ConnectError)) from None
        if 300 <= response.status_code < 400:
            raise ControllerAnswerError(f"the server at {self.url} answered {method} {path} with "
                                        f"{response.status_code} (to {response.headers.get('location', 'nowhere')!r}): "
                                        "the controller never redirects")
        headers = [(k, v) for k, v in response.headers.multi_items() if k not in ("content-encoding", "content-length")]
        return httpx.Response(response.status_code, headers=headers, content=b"".join(chunks),
                              request=response.request)

    def _json(self, response: httpx.Response) -> dict[str, Any]:
        """The JSON object a 2xx answer holds; :class:`ControllerAnswerError` if it holds anything else."""
        try:
            result = response.json()
        except ValueError:
            result = None
        if not isinstance(result, dict):
            raise ControllerAnswerError(
                f"the server at {self.url} answered {response.request.method} {response.request.url.path} with "
                f"{response.status_code} and not a JSON object: {response.text[:200]!r}")
        return result

    def _checked(self, response: httpx.Response, shape: Shape) -> dict[str, Any]:
        """The JSON object of a 2xx answer with each key of ``shape`` holding a value of its type,
        or an int in its range (a key the controller may leave out may be missing, if its
        range holds no 0: ``trainer_session``); :class:`ControllerAnswerError` otherwise, as for an
        answer that is no JSON object: a submit is not taken as stored, nor a grant of -1 or
        10^300 sequences handed to the worker, nor a pull's batch without its groups taken as
        pulled (its retry keeps the pull's id)."""
        result = self._json(response)
        for key, kind in shape.items():
            value = result.get(key)
            if isinstance(kind, range):
                fits = (key not in result and 0 not in kind) or (
                    isinstance(value, int) and not isinstance(value, bool) and value in kind)
            else:
                fits = isinstance(value, kind)
            if not fits:
                said = f"{key}={str(value)[:50]!r}" if key in result else f"no {key}"
                raise ControllerAnswerError(
                    f"the server at {self.url} answered {response.request.method} {response.request.url.path} "
                    f"with {response.status_code} and {said}: not the controller's answer")
        return result

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
              timeout_s: float | None = None, answer: Shape | None = None) -> dict[str, Any]:
        """The 2xx answer to ``method path`` (of ``answer``'s shape: :meth:`_checked`)."""
        response = self._send(method, path, timeout_s, json=body)
        if response.status_code == 404:
            raise UnknownOnControllerError(_detail(response))
        if response.status_code >= 400:
            raise _api_error(response)
        return self._checked(response, answer or {})

    # workers
    def register(self, worker_id: str, info: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", f"/workers/{worker_id}/register", info)

    def heartbeat(self, worker_id: str, info: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", f"/workers/{worker_id}/heartbeat", info)

    # servers
    def endpoints(self, version: int = -1, wait_s: float = 0.0, latest_weights_only: bool = False) -> dict[str, Any]:
        """Routable servers; with ``version`` and ``wait_s``, a long-poll for a change;
        ``latest_weights_only``: only servers at the latest published weights."""
        weights = "&weights=latest" if latest_weights_only else ""
        return self._call("GET", f"/endpoints?version={int(version)}&wait_s={float(wait_s)}{weights}",
                          timeout_s=float(wait_s) + 10.0)

    def report_load(self, client_id: str, outstanding: dict[str, int], sent: int = 0, retried: int = 0,
                    failed: int = 0, timeout_s: float | None = None) -> dict[str, Any]:
        return self._call("POST", "/endpoints/load", {"client_id": client_id, "outstanding": outstanding,
                                                      "sent": sent, "retried": retried, "failed": failed},
                          timeout_s=timeout_s)

    # rollouts (workers)
    def submit_group(self, group: dict[str, Any] | bytes, max_wait_s: float = 3600.0,
                     sleep: Any = None) -> dict[str, Any]:
        """Submit one scored group; never drops it while ``max_wait_s`` lasts. A full buffer (429)
        or a server error (5xx: the store failed, a restart) is tried again after ``Retry-After``
        (or a backoff of up to 10 s), as is a controller that does not answer; a refusal (4xx)
        raises :class:`ApiError` at once (409: ``policy_version`` past the trainer's). A group
        already too stale is answered ``{"accepted": false, "reason": "stale", ...}`` (not stored).

        A resend is safe: the group id makes the submit idempotent. When a try of this call may
        have reached the controller before it failed (no answer, or a 5xx), a later "a retry of a
        group stored before" (``accepted`` false, no reason) means that try stored it: answered
        ``{"accepted": true, "resent": true}``.
        """
        body = group if isinstance(group, bytes) else json.dumps(group, separators=(",", ":")).encode()
        pause = sleep or time.sleep
        deadline = time.monotonic() + max_wait_s
        delay_s = 0.5
        maybe_stored = False  # a try failed after it may have reached the controller
        while True:
            try:
                response = self._send("POST", "/rollouts", content=body, headers={"content-type": "application/json"})
                code = response.status_code
                result = self._checked(response, {"accepted": bool}) if code < 400 else {}
            except ControllerUnreachableError as exc:  # no answer, or not the controller's
                maybe_stored = maybe_stored or not exc.not_connected
                if time.monotonic() > deadline:
                    raise
                pause(delay_s)
                delay_s = min(10.0, delay_s * 2)
                continue
            maybe_stored = maybe_stored or code >= 500
            if (code == 429 or code >= 500) and time.monotonic() < deadline:
                if code >= 500:
                    log.warning("submit of a rollout group answered %d (%s); trying again", code, _detail(response))
                pause(_retry_after_s(response, 1.0 if code == 429 else delay_s))
                delay_s = min(10.0, delay_s * 2) if code >= 500 else delay_s
                continue
            if code >= 400:
                raise ApiError(code, _detail(response))
            return stored_by_an_earlier_try(result) if maybe_stored else result

    def admit(self, sequences: int, worker_id: str, admission_id: str | None = None,
              whole: bool = False) -> dict[str, Any]:
        """Ask to start rollouts (the staleness gate); answers how many may start now (``whole``:
        all or none). What is granted is ``worker_id``'s lease: its submits use it.
        ``admission_id`` (up to 64 of ``[0-9A-Za-z_-]``), one per ask: sent again with a retry, it
        gets the first try's grant, granted once."""
        body: dict[str, Any] = {"sequences": sequences, "worker_id": worker_id}
        if admission_id is not None:
            body["admission_id"] = admission_id
        if whole:
            body["whole"] = True
        return self._call("POST", "/rollouts/admission", body, answer={"granted": range(sequences + 1)})

    def release_admission(self, sequences: int, worker_id: str, release_id: str) -> dict[str, Any]:
        """Give back admitted sequences ``worker_id`` will not submit; ``release_id`` makes a retry
        release nothing again. Answers how many were released."""
        return self._call("POST", "/rollouts/admission/release",
                          {"sequences": sequences, "worker_id": worker_id, "release_id": release_id},
                          answer={"released": range(sequences + 1)})

    # trainer
    def trainer_register(self, trainer_id: str = "trainer") -> dict[str, Any]:
        return self._call("POST", "/trainer/register", {"trainer_id": trainer_id},
                          answer={"trainer_session": range(1, 2**63)})

    def pull_batch(self, pull_id: str | None = None, session: int | None = None) -> dict[str, Any] | None:
        """The next batch ({batch_id, groups}), or None when not enough sequences are buffered.
        ``pull_id`` (up to 64 of ``[0-9A-Za-z_-]``): sent again with a retry, it gets the batch the
        first try got if that answer was lost (while it is not acknowledged). ``session``: the
        ``trainer_session`` of :meth:`trainer_register` (TrainerSupersededError once a newer
        trainer registered)."""
        params: dict[str, Any] = {"pull_id": pull_id} if pull_id is not None else {}
        if session is not None:
            params["trainer_session"] = session
        response = self._send("POST", "/trainer/batch", max_bytes=BATCH_MAX_BYTES, params=params or None)
        if response.status_code == 204:
            return None
        if response.status_code >= 400:
            raise _api_error(response)
        batch = self._checked(response, {"batch_id": str, "groups": list, "lost_group_ids": (list, type(None))})
        batch["lost_group_ids"] = batch.get("lost_group_ids") or []  # left out by a controller older than the key
        if not all(isinstance(group, dict) for group in batch["groups"]):
            raise ControllerAnswerError(f"the server at {self.url} answered POST /trainer/batch with a group that "
                                        "is not a JSON object: not the controller's answer")
        return batch

    def ack_batch(self, batch_id: str, session: int | None = None) -> dict[str, Any]:
        return self._call("POST", f"/trainer/batch/{batch_id}" + _with_session("/ack", session))

    def set_version(self, version: int, recovered: bool = False, weights: str | None = None,
                    session: int | None = None) -> dict[str, Any]:
        """Publish the trainer's policy version (with where its weights are, for server workers);
        ApiError 409 for a plain publish lower than the current one or more than max_staleness + 1
        past it (``recovered=True`` after a resume), 422 for a malformed ``weights``,
        TrainerSupersededError for a ``session`` older than the newest registration."""
        body: dict[str, Any] = {"version": version, "recovered": recovered}
        if weights is not None:
            body["weights"] = weights
        return self._call("POST", _with_session("/trainer/version", session), body)

    def global_status(self) -> dict[str, Any]:
        return self._call("GET", "/global-status")

    # node agents
    def report_gpu_health(self, report: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/agent/report", report)

    # operators
    def status(self) -> dict[str, Any]:
        return self._call("GET", "/controller/status")

    def scale(self, workers: int) -> dict[str, Any]:
        return self._call("POST", "/admin/scale", {"workers": workers})

    def pause(self) -> dict[str, Any]:
        return self._call("POST", "/admin/pause")

    def resume(self) -> dict[str, Any]:
        return self._call("POST", "/admin/resume")

    def wake_all(self) -> dict[str, Any]:
        return self._call("POST", "/admin/wake-all")

    def stop(self) -> dict[str, Any]:
        return self._call("POST", "/admin/stop")

    def drain(self, worker_id: str) -> dict[str, Any]:
        return self._call("POST", f"/admin/drain/{worker_id}")

    def cordon(self, node: str, gpu: int, reason: str) -> dict[str, Any]:
        return self._call("POST", "/admin/cordon", {"node": node, "gpu": gpu, "reason": reason})

    def uncordon(self, node: str, gpu: int, reason: str = "") -> dict[str, Any]:
        return self._call("POST", "/admin/uncordon", {"node": node, "gpu": gpu, "reason": reason})


def _retry_after_s(response: httpx.Response, default_s: float) -> float:
    """The answer's ``Retry-After`` in seconds (0 to 300), or ``default_s`` without a usable one."""
    try:
        seconds = float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return default_s
    return default_s if math.isnan(seconds) else min(300.0, max(0.0, seconds))


def _with_session(path: str, session: int | None) -> str:
    return path if session is None else f"{path}?trainer_session={int(session)}"


def _api_error(response: httpx.Response) -> ApiError:
    """The error an answer of 400 or more stands for (a superseded trainer's 409 has its own)."""
    detail = _detail(response)
    if response.status_code == 409 and detail.startswith("trainer session superseded"):
        return TrainerSupersededError(response.status_code, detail)
    return ApiError(response.status_code, detail)


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    detail = body.get("detail", body) if isinstance(body, dict) else body
    if isinstance(detail, list) and detail and all(isinstance(e, dict) and "msg" in e for e in detail):
        detail = "; ".join(_field_error(e) for e in detail)  # a 422: each refused field and why
    return str(detail)[:500]


def _field_error(error: dict[str, Any]) -> str:
    """``{"loc": ["body", "workers"], "msg": ...}`` as ``workers: ...``."""
    loc = [str(part) for part in error.get("loc", []) if part not in ("body", "path", "query")]
    return f"{'.'.join(loc)}: {error['msg']}" if loc else str(error["msg"])
