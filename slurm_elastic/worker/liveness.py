"""Liveness of a ready server, probed on its own node by the worker wrapper.

A hung engine (it accepts connections and never answers, a known vLLM/SGLang failure) passes
no probe: the probe thread counts failed probes in a row and the wrapper reports the count with
its heartbeats; the controller decides (:mod:`slurm_elastic.core.liveness`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

log = logging.getLogger(__name__)


def probe_server(port: int, http_path: str, timeout_s: float) -> bool:
    """A server on this node answers: an HTTP 2xx on ``http_path`` within ``timeout_s``, or (no
    path) a TCP connect."""
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            if not http_path:
                return True
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(f"GET {http_path} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            status_line = sock.recv(64).split(b"\r\n", 1)[0].split()
            return len(status_line) >= 2 and status_line[1].startswith(b"2")
    except OSError:
        return False


class LivenessProbe:
    """Probes ``port`` every ``interval_s`` in a daemon thread; :attr:`failures` counts failed
    probes in a row (0 after any answer)."""

    def __init__(self, port: int, http_path: str, interval_s: float, timeout_s: float, name: str = "") -> None:
        self.port, self.http_path = port, http_path
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.name = name
        self.failures = 0
        self.probes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="liveness", daemon=True)

    def start(self) -> LivenessProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            live = probe_server(self.port, self.http_path, self.timeout_s)
            self.probes += 1
            if not live:
                self.failures += 1
                log.warning("worker %s: liveness probe %s failed (%d in a row, timeout %g s)",
                            self.name, self.http_path or "(TCP connect)", self.failures, self.timeout_s)
            elif self.failures:
                log.info("worker %s: live again after %d failed probes", self.name, self.failures)
                self.failures = 0
