"""Serve the controller's API: uvicorn in a background thread, on a socket bound up front."""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)


def default_listen_host() -> str:
    """This host's address as other nodes reach it (the batch host's)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class ApiServer:
    """uvicorn serving ``app`` on ``host:port`` (0 = any free port) in a daemon thread."""

    def __init__(self, app: FastAPI, host: str, port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, int(self.sock.getsockname()[1])
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2,
                                proxy_headers=False)  # clients reach the controller directly, never via a proxy
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, wait_s: float = 10.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + wait_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the API server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()
