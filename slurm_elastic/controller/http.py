"""The controller's control-plane routes: worker registration and heartbeats, node agents' reports,
operators' commands. A FastAPI router; the job's bearer token is checked in front of every route,
before any body is read (:mod:`slurm_elastic.controller.guard`).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request, Response, status
from fastapi import Path as PathParam

from slurm_elastic.client.wire import (
    WORKER_ID,
    AgentReportBody,
    GpuRef,
    Heartbeat,
    LoadReport,
    Registration,
    ScaleRequest,
)
from slurm_elastic.controller.framing import CLIENT_DONE
from slurm_elastic.controller.runtime import Controller, UnknownWorkerError
from slurm_elastic.errors import TransitionError


async def _disconnect(request: Request) -> None:
    """Returns once the client of ``request`` has gone, or has shut its sending side (which a
    client that closed its socket also shows; the server says so: :data:`CLIENT_DONE`)."""
    done = request.scope.get("extensions", {}).get(CLIENT_DONE)
    waits = {asyncio.ensure_future(_gone(request))} | ({asyncio.ensure_future(done.wait())} if done else set())
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


async def _gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


MAX_LONG_POLLS = 256  # /endpoints polls that may wait at once (a router or client each holds one)


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    """Whether an ``If-None-Match`` header names ``etag``: ``*``, or a tag of its list, weak
    (``W/"7"``) or strong, compared by its quoted value (RFC 9110's weak comparison)."""
    if not if_none_match:
        return False
    tags = [tag.strip() for tag in if_none_match.split(",")]
    return any(tag == "*" or tag.removeprefix("W/") == etag for tag in tags)


def control_router(controller: Controller) -> APIRouter:
    """Routes that call into ``controller``."""
    router = APIRouter()

    def unknown(exc: KeyError) -> HTTPException:
        return HTTPException(status.HTTP_404_NOT_FOUND, f"unknown: {exc.args[0] if exc.args else exc}")

    @router.post("/workers/{worker_id}/register", tags=["workers"])
    def register(worker_id: Annotated[str, PathParam(pattern=WORKER_ID)], body: Registration) -> dict[str, Any]:
        try:
            return controller.register_worker(worker_id, body.model_dump())
        except UnknownWorkerError as exc:
            raise unknown(exc) from None

    @router.post("/workers/{worker_id}/heartbeat", tags=["workers"])
    def heartbeat(worker_id: Annotated[str, PathParam(pattern=WORKER_ID)], body: Heartbeat) -> dict[str, Any]:
        try:
            return controller.heartbeat(worker_id, body.model_dump(exclude_none=True))
        except UnknownWorkerError as exc:
            raise unknown(exc) from None

    @router.post("/agent/report", tags=["health"])
    def agent_report(report: AgentReportBody) -> dict[str, Any]:
        try:
            return controller.report_gpu_health(report.to_core())
        except UnknownWorkerError as exc:
            raise unknown(exc) from None

    @router.get("/endpoints", tags=["servers"])
    async def endpoints(request: Request, response: Response,
                        version: Annotated[int, Query(ge=-1, le=2**63 - 1)] = -1,
                        wait_s: Annotated[float, Query(ge=0, le=60, allow_inf_nan=False)] = 0.0,
                        weights: Literal["any", "latest"] = "any") -> Any:
        """Routable servers. Long-poll: returns when the set is no longer ``version`` (or after ``wait_s``).
        ETag is the version; ``If-None-Match`` naming the current one (or ``*``) answers 304.
        ``weights=latest``: only servers at the latest published weights. At most MAX_LONG_POLLS
        wait at once; past them a poll that would wait (its ``version`` is the current one) gets
        503 with Retry-After (the Router backs off), and one that would not is answered: polls
        cannot take every connection from the workers' heartbeats, nor turn into a busy loop of
        answers that come at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        latest_only = weights == "latest"
        gone = asyncio.ensure_future(_disconnect(request))  # a client that left ends its poll
        try:
            with controller.endpoints_changed.watch() as changed:  # this poll counts among the waiting
                view = controller.endpoints_view(latest_only)
                if (wait_s > 0 and view["version"] == version
                        and controller.endpoints_changed.waiting() > MAX_LONG_POLLS):
                    raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE,
                                        f"{MAX_LONG_POLLS} polls wait already: poll again after Retry-After, or "
                                        "without wait_s", headers={"Retry-After": "1"})
                while view["version"] == version and loop.time() < deadline and not gone.done():
                    change = asyncio.ensure_future(changed.wait())
                    await asyncio.wait({change, gone}, timeout=deadline - loop.time(),
                                       return_when=asyncio.FIRST_COMPLETED)
                    change.cancel()
                    changed.clear()
                    view = controller.endpoints_view(latest_only)
        finally:
            gone.cancel()
        etag = f'"{view["version"]}"'
        if etag_matches(request.headers.get("if-none-match"), etag):
            return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
        response.headers["ETag"] = etag
        return view

    @router.post("/endpoints/load", tags=["servers"])
    def endpoints_load(body: LoadReport) -> dict[str, Any]:
        return controller.report_load(body.client_id, body.outstanding, body.sent, body.retried, body.failed)

    @router.get("/controller/status", tags=["status"])
    def controller_status() -> dict[str, Any]:
        return controller.status()

    @router.post("/admin/scale", tags=["admin"])
    def scale(body: ScaleRequest) -> dict[str, Any]:
        return controller.scale(body.workers)

    @router.post("/admin/pause", tags=["admin"])
    def pause() -> dict[str, Any]:
        return controller.pause()

    @router.post("/admin/resume", tags=["admin"])
    def resume() -> dict[str, Any]:
        return controller.resume()

    @router.post("/admin/wake-all", tags=["admin"])
    def wake_all() -> dict[str, Any]:
        return controller.wake_all()

    @router.post("/admin/stop", tags=["admin"])
    def stop() -> dict[str, Any]:
        """The controller exits 0 (a batch script's restart loop ends); worker steps keep running."""
        return controller.request_stop()

    @router.post("/admin/drain/{worker_id}", tags=["admin"])
    def drain(worker_id: Annotated[str, PathParam(pattern=WORKER_ID)]) -> dict[str, Any]:
        try:
            return controller.drain(worker_id)
        except UnknownWorkerError as exc:
            raise unknown(exc) from None
        except TransitionError as exc:
            raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None

    @router.post("/admin/cordon", tags=["admin"])
    def cordon(body: GpuRef) -> dict[str, Any]:
        try:
            return controller.cordon(body.node, body.gpu, body.reason)
        except UnknownWorkerError as exc:
            raise unknown(exc) from None

    @router.post("/admin/uncordon", tags=["admin"])
    def uncordon(body: GpuRef) -> dict[str, Any]:
        try:
            return controller.uncordon(body.node, body.gpu, body.reason)
        except UnknownWorkerError as exc:
            raise unknown(exc) from None

    return router
