"""A plain TCP listener that records every byte sent to it and never answers: what another
user's service on a dead controller's port would see."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class RecordingListener:
    """Accepts connections on 127.0.0.1, keeps what each sends until its request head ends (or it
    stops sending), then closes it."""

    def __init__(self, port: int = 0) -> None:
        self.server = socket.create_server(("127.0.0.1", port))
        self.server.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.connections = 0
        self.received = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _peer = self.server.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(0.5)
                try:
                    while b"\r\n\r\n" not in self.received and (chunk := conn.recv(65536)):
                        self.received += chunk
                except TimeoutError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.server.close()


@contextmanager
def recording_listener(port: int = 0) -> Iterator[RecordingListener]:
    listener = RecordingListener(port)
    try:
        yield listener
    finally:
        listener.close()
