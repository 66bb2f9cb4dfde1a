"""A worker's line to its controller that follows the controller across restarts.

If the controller does not answer, the URL is re-read from ``controller.json`` in the job's
state directory (a restarted controller may listen elsewhere; :mod:`slurm_elastic.client.follow`)
and the call is tried once more. So it is, when the file changed since its last read, after an
error answer (another job's controller, or any other server, on the old port answers 403 or 404
for ever; a ``stat`` alone while the file is unchanged).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from slurm_elastic.client.follow import FollowedClient
from slurm_elastic.errors import ApiError, ControllerUnreachableError


class WorkerCalls(Protocol):
    """What a worker calls on its controller (``ControlClient`` and ``StepControlClient`` both do)."""

    url: str

    def register(self, worker_id: str, info: dict[str, Any]) -> dict[str, Any]: ...

    def heartbeat(self, worker_id: str, info: dict[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


C = TypeVar("C", bound=WorkerCalls)


class FollowingControl(FollowedClient[C]):
    """register/heartbeat for one worker, through a client (made by ``connect(url, token)``) that
    re-resolves the controller's URL. The old client stays open until :meth:`close` (the
    heartbeat thread and the worker's own calls share this line, and one may be mid-call on it)."""

    def __init__(self, worker_id: str, url: str, token: str, state_dir: Path | None,
                 connect: Callable[[str, str], C]) -> None:
        super().__init__(url, token, state_dir, connect)
        self.worker_id = worker_id

    def _call(self, method: str, payload: dict[str, Any]) -> dict[str, Any]:
        client = self.client
        try:
            result: dict[str, Any] = getattr(client, method)(self.worker_id, payload)
            return result
        except ControllerUnreachableError:
            if not self.refresh(force=True) and self.client is client:  # nor did another thread follow it
                raise
        except ApiError:  # the controller's refusal, or another server's on its old port
            if not self.refresh() and self.client is client:
                raise
        retried: dict[str, Any] = getattr(self.client, method)(self.worker_id, payload)
        return retried

    def register(self, info: dict[str, Any]) -> dict[str, Any]:
        return self._call("register", info)

    def heartbeat(self, payload: dict[str, Any]) -> dict[str, Any]:
        return self._call("heartbeat", payload)
