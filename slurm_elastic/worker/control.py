"""A worker's line to its controller that follows the controller across restarts.

If the controller does not answer, the URL is re-read from ``controller.json`` in the job's
state directory (a restarted controller may listen elsewhere) and the call is tried once more.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from slurm_elastic.client.files import read_controller_url
from slurm_elastic.errors import ControllerUnreachableError


class WorkerCalls(Protocol):
    """What a worker calls on its controller (``ControlClient`` and ``StepControlClient`` both do)."""

    url: str

    def register(self, worker_id: str, info: dict[str, Any]) -> dict[str, Any]: ...

    def heartbeat(self, worker_id: str, info: dict[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


C = TypeVar("C", bound=WorkerCalls)


class FollowingControl(Generic[C]):
    """register/heartbeat for one worker, through a client (made by ``connect(url, token)``) that
    re-resolves the controller's URL."""

    def __init__(self, worker_id: str, url: str, token: str, state_dir: Path | None,
                 connect: Callable[[str, str], C]) -> None:
        self.worker_id = worker_id
        self.token = token
        self.state_dir = state_dir
        self._connect = connect
        self.client = connect(url, token)
        self._retired: list[C] = []  # clients of earlier URLs: another thread may still be in a call on one
        self._lock = threading.Lock()

    def refresh(self) -> bool:
        """Re-read the controller's URL from the state directory; True if it changed. The old
        client stays open until :meth:`close` (the heartbeat thread and the worker's own calls
        share this line, and one may be mid-call on it)."""
        url = read_controller_url(self.state_dir) if self.state_dir else ""
        with self._lock:
            if not url or url.rstrip("/") == self.client.url:
                return False
            self._retired.append(self.client)
            self.client = self._connect(url, self.token)
            return True

    def _call(self, method: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            result: dict[str, Any] = getattr(self.client, method)(self.worker_id, payload)
            return result
        except ControllerUnreachableError:
            if not self.refresh():
                raise
            retried: dict[str, Any] = getattr(self.client, method)(self.worker_id, payload)
            return retried

    def register(self, info: dict[str, Any]) -> dict[str, Any]:
        return self._call("register", info)

    def heartbeat(self, payload: dict[str, Any]) -> dict[str, Any]:
        return self._call("heartbeat", payload)

    def close(self) -> None:
        for client in (*self._retired, self.client):
            client.close()
