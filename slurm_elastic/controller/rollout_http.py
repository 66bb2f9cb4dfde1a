"""The rollout queue's routes: workers submit scored rollouts (:mod:`.submit`), the trainer pulls
and acknowledges batches and publishes policy versions. Token-protected like the rest of the API.

Payloads are validated (pydantic) and stored as the exact bytes received; a batch is served by
concatenating the stored groups, so what a worker sent is what the trainer gets.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, HTTPException, Query, Request, Response, status
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from prometheus_client import generate_latest
from starlette.types import Message, Receive, Scope, Send

from slurm_elastic.client.wire import Admission, AdmissionRelease, TrainerHello, VersionUpdate
from slurm_elastic.controller.beats import (
    AgentReportEndpoint,
    HeartbeatEndpoint,
    read_body,
    replaying,
)
from slurm_elastic.controller.control_plane import UnknownWorkerError
from slurm_elastic.controller.guard import Headers, RequestGuard, send_answer
from slurm_elastic.controller.http_errors import (
    invalid_request,
    storage_failed,
    trainer_session_refused,
)
from slurm_elastic.controller.json_body import nested_deeper_than
from slurm_elastic.controller.metrics import metrics_registry
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.submit import RolloutGroup, SubmitEndpoint, inline_schema
from slurm_elastic.controller.weights import publish_weights
from slurm_elastic.core.staleness import VersionRefused
from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.queue import RolloutQueue, TrainerSessionRefused, UnknownBatchError

log = logging.getLogger(__name__)
Session = Annotated[int | None, Query(ge=1, le=2**63 - 1, description=(
    "the trainer_session its registration answered: a call with an older one than the newest registration "
    "is refused (409), so a second live trainer cannot take batches, as is one never issued; omitted: not checked"))]


class ControllerApp(FastAPI):
    """The controller's FastAPI app. Every request passes its :class:`RequestGuard` first (the
    token, then the body's size, before any body is read); ``POST /rollouts`` is then answered
    before the framework's per-request machinery (telemetry hooks, middleware, routing), so the
    hot route costs only its own checks (the same handler is also a FastAPI route, so OpenAPI
    documents it); so are heartbeats and agent reports when they can be (:mod:`.beats`). A HEAD
    request is answered as its GET, without the body. A WebSocket handshake is closed before it is accepted (the server answers 403), whatever it carries: no route speaks
    WebSocket and the token check is the HTTP requests'; only lifespan events pass besides."""

    def __init__(self, guard: RequestGuard, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.guard = guard
        self.submit_endpoint: SubmitEndpoint | None = None
        self.heartbeat_endpoint: HeartbeatEndpoint | None = None
        self.agent_report_endpoint: AgentReportEndpoint | None = None
        self._openapi_bytes = b""
        for error in (StateFileError, OSError):
            self.add_exception_handler(error, storage_failed)
        self.add_exception_handler(RequestValidationError, invalid_request)
        self.add_exception_handler(TrainerSessionRefused, trainer_session_refused)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "no WebSocket routes"})
            return
        if scope["type"] != "http":
            if scope["type"] != "lifespan":
                raise ValueError(f"the controller's API serves no {scope['type']!r} scope")
            await super().__call__(scope, receive, send)
            return
        passed = await self.guard(scope, receive, send)
        if passed is None:
            return
        receive, send = passed
        if scope["method"] == "HEAD":  # answered as GET is, its head alone
            scope, send = {**scope, "method": "GET"}, head_only(send)
        if scope["path"] == "/openapi.json" and scope["method"] == "GET":  # made once: it cost 4 ms an answer
            self._openapi_bytes = self._openapi_bytes or json.dumps(self.openapi()).encode()
            await send_answer(send, (200, self._openapi_bytes, [(b"content-type", b"application/json")]))
            return
        if (fast := self._fast_path(scope)) is not None:
            body = await read_body(receive)  # nested too deep: the route refuses it, as JsonBodies does for routes
            answer = None if body is None or nested_deeper_than(body) else fast(body)
            if answer is not None:
                await send_answer(send, answer)
                return
            receive = replaying(body or b"", receive)
        endpoint = self.submit_endpoint
        if endpoint is None or scope["path"] != "/rollouts" or scope["method"] != "POST":
            await super().__call__(scope, receive, send)
            return
        await send_answer(send, await endpoint.answer(receive))

    def _fast_path(self, scope: Scope) -> Callable[[bytes], tuple[int, bytes, Headers] | None] | None:
        """The fast path of a heartbeat or an agent report (:mod:`.beats`), None for other requests."""
        beats = self.heartbeat_endpoint
        if beats is not None and (worker_id := beats.worker_id(scope)) is not None:
            return lambda body: beats.answer(worker_id, body)
        reports = self.agent_report_endpoint
        if reports is not None and reports.matches(scope):
            return reports.answer
        return None


def head_only(send: Send) -> Send:
    """``send`` passing an answer's head whole (its Content-Length too) and none of its body: the
    answer to a HEAD request."""
    async def without_body(message: Message) -> None:
        await send({**message, "body": b""} if message["type"] == "http.response.body" else message)
    return without_body


def rollout_router(controller: Controller, queue: RolloutQueue) -> APIRouter:
    """The queue's routes (the token is checked in front of them: :class:`ControllerApp`)."""
    router = APIRouter()
    endpoint = SubmitEndpoint(queue)

    @router.post("/rollouts", tags=["rollouts"], openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": inline_schema(RolloutGroup)}}}},
        responses={200: {"description": '{"accepted": true}; false: a retry of a stored group, or with '
                                        '"reason": "stale" a group too old to train on (not stored)'},
                   409: {"description": "policy_version is past the trainer's current version (not stored)"},
                   413: {"description": "group over the size limit"},
                   429: {"description": "buffer full: retry after Retry-After seconds"},
                   503: {"description": "the store did not take the group: retry after Retry-After seconds"}})
    async def submit(request: Request) -> Response:
        """Served by :class:`ControllerApp` before the framework; the same handler here."""
        code, body, headers = await endpoint.answer(request.receive)
        return Response(body, status_code=code, headers={k.decode(): v.decode() for k, v in headers})

    @router.post("/rollouts/admission", tags=["rollouts"], responses={
        404: {"description": "worker_id is not a worker this controller launched (no live record, no listed step)"}})
    def admission(body: Admission) -> dict[str, Any]:
        try:  # a lease under an id no step has would hold the staleness room until admission_ttl_s
            controller.check_lease_holder(body.worker_id)
        except UnknownWorkerError as exc:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"unknown: {exc.args[0]}") from None
        cfg = queue.config
        if body.whole and body.sequences > cfg.max_concurrent:  # a hard bound: it would wait for ever
            raise HTTPException(422, [{
                "loc": ["body", "sequences"], "type": "admission_over_bound", "max_concurrent": cfg.max_concurrent,
                "msg": f"{body.sequences} sequences asked for whole can never be granted: at most "
                       f"queue.max_concurrent = {cfg.max_concurrent} run at once; ask for at most that many at a time"}])
        granted = queue.admit(body.sequences, body.worker_id, body.admission_id or "", body.whole)
        stats = queue.stats()
        return {"granted": granted, "staleness_capacity": stats["staleness_capacity"],
                "most_at_once": queue.most_at_once(),
                "policy_version": stats["policy_version"]}

    @router.post("/rollouts/admission/release", tags=["rollouts"])
    def admission_release(body: AdmissionRelease) -> dict[str, Any]:
        released = queue.give_back(body.sequences, body.worker_id, body.release_id)
        return {"released": released, "staleness_capacity": queue.stats()["staleness_capacity"]}

    @router.post("/trainer/register", tags=["trainer"])
    def trainer_register(body: TrainerHello) -> dict[str, Any]:
        session, again = queue.trainer_restarted()
        log.info("a trainer registered (id %s, session %d); %d unacknowledged batches go to it again",
                 body.trainer_id, session, again)
        return {"trainer_id": body.trainer_id, "trainer_session": session, "unacked_batches_handed_again": again,
                "batch_size": queue.config.batch_size, "policy_version": queue.stats()["policy_version"]}

    @router.post("/trainer/batch", tags=["trainer"], responses={
        409: {"description": "trainer_session is older than the newest registration (another trainer registered), or was never issued"},
        503: {"description": "the store cannot record the hand-out (disk full): nothing changed, retry"}})
    def pull(pull_id: Annotated[str | None, Query(pattern=r"^[0-9A-Za-z_-]{1,64}$", description=(
            "the trainer's name for this pull: a retry with the same id gets the same batch while it is "
            "not acknowledged (204 once it is)"))] = None, trainer_session: Session = None) -> Response:
        """The next batch; ``lost_group_ids`` names the groups quarantined (damaged on disk,
        never delivered) since the previous batch, named again with it until it is acknowledged."""
        batch = queue.pull(pull_id, trainer_session)  # StoreUnavailableError: 503 with Retry-After
        if batch is None:
            return Response(status_code=status.HTTP_204_NO_CONTENT)
        batch_id, payloads = batch
        lost = json.dumps(queue.lost_ids_for(batch_id)).encode()
        body = (b'{"batch_id":"' + batch_id.encode() + b'","groups":[' + b",".join(payloads)
                + b'],"lost_group_ids":' + lost + b"}")
        return Response(body, media_type="application/json")

    @router.post("/trainer/batch/{batch_id}/ack", tags=["trainer"], responses={
        409: {"description": "trainer_session is older than the newest registration (another trainer registered), or was never issued"}})
    def ack(batch_id: Annotated[str, PathParam(pattern=r"^[0-9a-f]{32}$")],
            trainer_session: Session = None) -> dict[str, Any]:
        try:
            return {"batch_id": batch_id, "acked": queue.ack(batch_id, trainer_session)}
        except UnknownBatchError:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"unknown batch {batch_id}") from None

    @router.post("/trainer/version", tags=["trainer"], responses={
        409: {"description": "a plain publish lower than the current version, or more than max_staleness + 1 "
                             "past it: publish with recovered=true after a checkpoint resume; or "
                             "trainer_session older than the newest registration, or never issued; or the "
                             "version's weights published before at another ref (a plain publish)"}})
    def version(body: VersionUpdate, trainer_session: Session = None) -> dict[str, Any]:
        if body.weights is not None and not body.recovered:
            with controller.lock:
                conflict = controller.weights.conflict(body.version, body.weights)
            if conflict is not None:
                raise HTTPException(status.HTTP_409_CONFLICT, conflict)
        try:
            queue.set_version(body.version, recovered=body.recovered, session=trainer_session)
        except VersionRefused as exc:
            raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
        weights = None if body.weights is None else publish_weights(controller, body.version, body.weights)
        return {"policy_version": queue.stats()["policy_version"],
                "staleness_capacity": queue.stats()["staleness_capacity"], "weights": weights}

    @router.get("/global-status", tags=["status"])
    def global_status() -> dict[str, Any]:
        ctl = controller.status()
        q = ctl["queue"] or queue.stats()
        return {
            "current_step": q["policy_version"], "queue_size": q["queued_sequences"],
            "total_processed": q["delivered_sequences"],
            "connected_workers": ctl["workers_by_state"].get("ACTIVE", 0),  # placeholders counted apart
            "batch_size": q["batch_size"],
            "rollout_pressure": q["queued_sequences"] / max(1, q["batch_size"]),
            "staleness_capacity": q["staleness_capacity"], "workers_by_state": ctl["workers_by_state"],
            "cordoned_gpus": ctl["cordoned_gpus"], "queue": q, "controller": ctl,
        }

    @router.get("/status", tags=["status"])
    def plain_status() -> dict[str, Any]:
        return {"queue": queue.stats(), "controller": controller.status()}

    @router.get("/metrics", tags=["status"])
    def metrics(request: Request) -> Response:
        connections = getattr(request.app.state, "connections", None)  # set by the ApiServer serving it
        return Response(generate_latest(metrics_registry(controller, queue, connections)),
                        media_type="text/plain; version=0.0.4")

    return router
