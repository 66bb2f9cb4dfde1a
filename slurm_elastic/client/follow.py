"""A line to the job's controller that follows it to a new address.

A restarted controller may listen on another port; ``controller.json`` in the job's state
directory says where. :class:`FollowedClient` re-reads it on :meth:`~FollowedClient.refresh` (a
``stat`` alone while the file has not changed since its last good read; a read forced after a
failed call) and connects to the URL it names when that differs from the one in use and is usable
(a damaged file is read again at the next refresh). Workers refresh when a call fails; routers also
while a long-poll waits, so an old port that still accepts connections does not hold them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, Protocol, TypeVar
from urllib.parse import urlsplit

from slurm_elastic.client.files import CONTROLLER_FILE, read_controller_url


class ControllerClient(Protocol):
    """What a followed client must have: the URL it calls, and ``close``."""

    url: str

    def close(self) -> None: ...


C = TypeVar("C", bound=ControllerClient)
FORCED_READ_MIN_S = 1.0  # forced reads of controller.json at most this often per line (a shared file system's load)


def usable_url(url: str) -> str | None:
    """``url`` without its trailing slash if it is an http(s) URL with a host a connection can be
    made to by name, and a numeric port if one is given; None if not (a damaged
    ``controller.json``: nothing to connect to). Parsed with the standard library: a worker's
    step imports no HTTP client to launch (tests/unit/test_step_calls.py)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a port that is no number, or out of range, raises here)
        host = parts.hostname or ""
        host.encode("idna")  # a label over 63 characters raises here, not at the connect
    except (ValueError, UnicodeError):
        return None
    return url.rstrip("/") if parts.scheme in ("http", "https") and host else None


class FollowedClient(Generic[C]):
    """``client``: made by ``connect(url, token)`` for the controller's current URL. A replaced
    client is closed at once with ``close_replaced`` (a call in flight on it then fails), else
    kept open until :meth:`close` (another thread may be mid-call on it)."""

    def __init__(self, url: str, token: str, state_dir: Path | None, connect: Callable[[str, str], C], *,
                 close_replaced: bool = False) -> None:
        self.token = token
        self.state_dir = state_dir
        self._connect = connect
        self._close_replaced = close_replaced
        self.client = connect(url, token)
        self._retired: list[C] = []  # clients of earlier URLs, open until close()
        self._seen: tuple[int, int, int] | None = None  # controller.json's (inode, mtime, size) at its last read
        self._lock = threading.Lock()
        self._closed = False  # after close(): no new client is made
        self._forced_at_s = -FORCED_READ_MIN_S  # the last forced read (time.monotonic)

    def refresh(self, force: bool = False) -> bool:
        """Re-read the controller's URL from the state directory if ``controller.json`` changed
        since its last good read (``force``: whatever its ``stat`` says, at most every
        FORCED_READ_MIN_S; after a failed call, as a shared file system may show an old ``stat``
        for a while); True if it names another usable
        URL (``client`` is then connected there). A read that gives no usable URL (a damaged or
        half-written file, a read error) is tried again at the next refresh."""
        if self.state_dir is None:
            return False
        try:
            st = os.stat(self.state_dir / CONTROLLER_FILE)
        except OSError:
            return False
        with self._lock:
            seen, now_s = (st.st_ino, st.st_mtime_ns, st.st_size), time.monotonic()
            force = force and now_s - self._forced_at_s >= FORCED_READ_MIN_S
            if self._closed or (seen == self._seen and not force):
                return False
            self._forced_at_s = now_s if force else self._forced_at_s
            url = usable_url(read_controller_url(self.state_dir))
            if url is None:
                return False
            self._seen = seen
            if url == self.client.url:
                return False
            try:
                connected = self._connect(url, self.token)
            except Exception:  # a URL the client's own checks refuse: as a damaged file
                return False
            replaced, self.client = self.client, connected
            if not self._close_replaced:
                self._retired.append(replaced)
        if self._close_replaced:
            replaced.close()
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._retired = [*self._retired, self.client], []
        for client in clients:
            client.close()
