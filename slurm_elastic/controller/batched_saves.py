"""Saves asked for by workers' registrations, written together by one thread.

Each save writes the whole state file (about 20 ms of CPU for 256 workers, under the
controller's lock). Written once per registration, 256 workers registering in a burst held the
lock for seconds and the tick waited behind them. Batched, a registration is written about
``wait_s`` after it was asked for (and the lock was free), together with every other one asked
for meanwhile; the tick's own save, every tick, may write it first. A controller killed before
that write leaves the worker's record as it was launched (STARTING) while its step runs: the
answer to its next heartbeat asks it to register again, which it does as a step whose command
runs (``command_started``: no pre-start check). The registration of a multi-node step's other
task is not asked again, so it is saved at once, not here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
SAVE_WITHIN_S = 1.0  # a registration waits this long for the others of its burst (then for the lock)


class BatchedSaves:
    """One thread that calls ``save`` at most once per ``wait_s`` while saves are asked for."""

    def __init__(self, save: Callable[[], None], wait_s: float = SAVE_WITHIN_S) -> None:
        self._save = save
        self.wait_s = wait_s
        self.saves = 0  # the saves called (a save finds nothing changed, or fails, at times), however many were asked for
        self._asked = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="batched-saves", daemon=True)
        self._thread.start()

    def ask(self) -> None:
        """Save soon (within ``wait_s``), with whatever else is asked for until then."""
        self._asked.set()

    def stop(self) -> None:
        """Write what was asked for and not written yet, then end the thread."""
        self._stop.set()
        self._asked.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            self._asked.wait()
            self._stop.wait(self.wait_s)  # gather the rest of the burst (at once when stopping)
            self._asked.clear()
            self._save_now()
            if self._stop.is_set() and not self._asked.is_set():  # nothing asked for during that save
                return

    def _save_now(self) -> None:
        try:
            self._save()
            self.saves += 1
        except Exception:  # the thread never dies: the next tick saves again
            log.exception("could not save the state after workers registered; the next tick tries again")
