"""Assemble and run the controller process: the loop, the API, the published URL."""

from __future__ import annotations

import errno
import gc
import logging
import socket
import threading
from pathlib import Path

from slurm_elastic import __version__
from slurm_elastic.client.locate import job_comment
from slurm_elastic.controller.beats import AgentReportEndpoint, HeartbeatEndpoint
from slurm_elastic.controller.config import ElasticConfig
from slurm_elastic.controller.files import (
    ensure_token,
    mark_stopped_by_operator,
    previous_port,
    publish,
)
from slurm_elastic.controller.guard import BODY_MAX_BYTES, RequestGuard
from slurm_elastic.controller.http import control_router
from slurm_elastic.controller.json_body import JsonBodies, routed
from slurm_elastic.controller.main import (
    build_controller,
    check_worker_shape,
    install_stop_handlers,
    job_id_from_env,
    open_state_dir,
    running_job,
    slurm_backend,
)
from slurm_elastic.controller.prolog_results import take_prolog_results
from slurm_elastic.controller.rollout_http import ControllerApp, rollout_router
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.serve import ApiServer, default_listen_host, keep_alive_for
from slurm_elastic.controller.submit import SubmitEndpoint
from slurm_elastic.controller.weights import WeightsPusher
from slurm_elastic.core.heartbeat_pace import longest_heartbeat_interval_s
from slurm_elastic.errors import ConfigError, SlurmError
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore

log = logging.getLogger(__name__)


def create_controller_app(controller: Controller, token: str | tuple[str, ...], queue: RolloutQueue | None = None) -> ControllerApp:
    """The controller's ASGI app: /healthz, the control plane, the rollout queue and the schema
    (/openapi.json), every route behind the job's token, checked with the body's size before any
    body is read; the framework's routes take their body as JSON whatever its Content-Type, refused
    when nested too deeply (:mod:`.json_body`). No interactive docs pages (they would be the only
    unauthenticated routes), no WebSocket. ``queue`` is the one ``controller`` was built with (its
    numbers drive the autoscaler)."""
    if queue is not None and controller.queue is not queue:
        raise ValueError("the routes would serve another queue than the controller reads: build the controller with queue=")
    submit_max_bytes = queue.config.max_group_bytes if queue is not None else BODY_MAX_BYTES
    app = ControllerApp(RequestGuard(token, submit_max_bytes), title="slurm-elastic controller", version=__version__,
                        docs_url=None, redoc_url=None, redirect_slashes=False)  # no redirect built from the client's Host
    app.add_middleware(JsonBodies, takes=routed(lambda: app.router.routes))

    @app.get("/healthz", tags=["status"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    app.include_router(control_router(controller))
    app.heartbeat_endpoint = HeartbeatEndpoint(controller)
    app.agent_report_endpoint = AgentReportEndpoint(controller)
    if queue is not None:
        app.include_router(rollout_router(controller, queue))
        app.submit_endpoint = SubmitEndpoint(queue)
    return app


def open_queue(config: ElasticConfig, state_dir: Path) -> RolloutQueue:
    qcfg = QueueConfig.from_mapping(config.queue)
    return RolloutQueue(RolloutStore(state_dir / "rollouts.sqlite", fsync=qcfg.fsync, direct_io=qcfg.direct_io), qcfg)


YOUNG_GC_THRESHOLD = 50_000  # container allocations between young collections (Python's default: 700)


def settle_heap() -> None:
    """After start-up: what was built lives as long as the process, so it is frozen out of every
    collection; and young collections run far less often (a submit allocates a few hundred
    short-lived objects, which reference counting frees, so frequent collections find little
    to collect and cost the API thread time)."""
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])


def keep_alive_s(config: ElasticConfig) -> int:
    """How long the API keeps an idle connection open: past the longest interval it tells workers
    to heart-beat at and the agents' (:func:`~slurm_elastic.controller.serve.keep_alive_for`)."""
    w = config.workers
    return keep_alive_for(longest_heartbeat_interval_s(w.heartbeat_interval_s, w.heartbeat_grace_s),
                          config.agent.interval_s)


def run_controller(config: ElasticConfig, stop: threading.Event) -> bool:
    """Run until ``stop`` is set (SIGTERM/SIGINT set it) or an operator's ``POST /admin/stop``;
    whether it was the operator's stop. Worker steps keep running afterwards."""
    job_id = job_id_from_env()
    backend = slurm_backend(config)
    job = running_job(backend, job_id)
    check_worker_shape(config, job)
    claimed = open_state_dir(config, job)  # before anything in it is read: it must be this job's
    state_dir = claimed.path
    tokens, token_file, token_note = ensure_token(state_dir)
    install_stop_handlers(stop)
    queue = open_queue(config, state_dir)
    ctl = build_controller(config, job, backend, state_dir, token_file=token_file, queue=queue)
    for note in (claimed.note, token_note):
        if note:
            ctl.note_state(note)
    if claimed.requeued:
        ctl.end_earlier_run()
    take_prolog_results(ctl, state_dir)
    host = config.controller.listen_host or default_listen_host()
    port = config.controller.listen_port or previous_port(state_dir, host)
    try:
        server = ApiServer(create_controller_app(ctl, tokens, queue), host, port, keep_alive_s=keep_alive_s(config))
    except OSError as exc:  # socket.gaierror included: a name that does not resolve
        if not config.controller.listen_host or not _a_config_mistake(exc):
            raise
        raise ConfigError(f"controller.listen_host = {host!r}: cannot serve there ({exc}); name an address of "
                          "this host, or leave it empty for this host's name") from None
    settle_heap()
    pusher = WeightsPusher(ctl).start()
    server.start()
    ctl.controller_url = server.url
    publish(state_dir, server.url, job_id)
    try:
        backend.set_job_comment(job_id, job_comment(state_dir))
    except SlurmError as exc:  # never fatal: each allocation check tries again
        log.warning("could not record the state directory in the job comment: %s", exc)
    log.info("controller for job %d at %s (state %s)", job_id, server.url, state_dir)
    try:
        ctl.run_forever(stop)
    finally:
        ctl.save()
        pusher.stop()
        server.stop()
        queue.store.close()
        if ctl.stop_requested.is_set():
            mark_stopped_by_operator(state_dir)
            log.info("controller stopped by the operator (slurm-elastic stop): no controller follows; the job's "
                     "other steps run until they end or `scancel %d`", job_id)
        else:
            log.info("controller stopped by a signal; worker steps keep running and a new controller (the batch "
                     "script starts one) adopts them")
    return ctl.stop_requested.is_set()


def _a_config_mistake(exc: OSError) -> bool:
    """A bind error that a restart cannot cure: no such address here, or no such name."""
    return isinstance(exc, socket.gaierror) or exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)
