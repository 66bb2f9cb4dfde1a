"""Wake-ups for coroutines waiting on a change made in any thread (the routable set of servers,
changed by the tick, the API's worker threads or the weights pusher)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator


class Changes:
    """Coroutines wait until a thread calls :meth:`notify` or their time is up.

    A waiter registers before it looks at the state it waits on (:meth:`watch`), so a change made
    between its look and its wait still wakes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def notify(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits there any more
                loop.call_soon_threadsafe(event.set)

    def waiting(self) -> int:
        """How many coroutines wait now."""
        with self._lock:
            return len(self._waiters)

    @contextlib.contextmanager
    def watch(self) -> Iterator[asyncio.Event]:
        """An event set by every :meth:`notify` while the block runs (clear it before each look)."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiters.add(waiter)
        try:
            yield waiter[1]
        finally:
            with self._lock:
                self._waiters.discard(waiter)
