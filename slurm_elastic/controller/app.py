"""Assemble and run the controller process: the loop, the API, the published URL."""

from __future__ import annotations

import logging
import threading

from fastapi import FastAPI

from slurm_elastic import __version__
from slurm_elastic.controller.config import ElasticConfig
from slurm_elastic.controller.files import ensure_token, previous_port, publish
from slurm_elastic.controller.http import control_router
from slurm_elastic.controller.locate import COMMENT_PREFIX
from slurm_elastic.controller.main import build_controller, install_stop_handlers, job_id_from_env
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.serve import ApiServer, default_listen_host
from slurm_elastic.controller.state import job_state_dir
from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.cli_backend import set_job_comment

log = logging.getLogger(__name__)


def create_controller_app(controller: Controller, token: str) -> FastAPI:
    """The controller's ASGI app: /healthz (open) and the token-protected control plane."""
    app = FastAPI(title="slurm-elastic controller", version=__version__)

    @app.get("/healthz", tags=["status"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    app.include_router(control_router(controller, token))
    return app


def run_controller(config: ElasticConfig, stop: threading.Event) -> None:
    """Run until ``stop`` is set (SIGTERM/SIGINT set it). Worker steps keep running afterwards."""
    job_id = job_id_from_env()
    state_dir = job_state_dir(job_id, config.controller.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    token, token_file = ensure_token(state_dir)
    install_stop_handlers(stop)
    ctl = build_controller(config, job_id, token_file=token_file)
    host = config.controller.listen_host or default_listen_host()
    server = ApiServer(create_controller_app(ctl, token), host,
                       config.controller.listen_port or previous_port(state_dir, host))
    server.start()
    ctl.controller_url = server.url
    publish(state_dir, server.url, job_id)
    try:
        set_job_comment(job_id, f"{COMMENT_PREFIX}{state_dir}")
    except SlurmError as exc:  # a convenience for the CLI, never fatal
        log.warning("could not record the state directory in the job comment: %s", exc)
    log.info("controller for job %d at %s (state %s)", job_id, server.url, state_dir)
    try:
        ctl.run_forever(stop)
    finally:
        ctl.save()
        server.stop()
        log.info("controller stopped; worker steps keep running and a new controller adopts them")
