"""Time the controller's process did not run: ``scontrol suspend`` of the job, a SIGSTOP, a frozen
VM. Nobody could heart-beat to it then (under ``scontrol suspend`` the workers were stopped too), so
the core moves its workers' clocks on by that time instead of finding every worker silent.

A thread wakes every ``interval_s``; a wake-up more than ``threshold_s`` late counts the lateness as
lost when the process used less CPU time meanwhile than a tenth of the lateness
(``PAUSED_CPU_SHARE``): a stopped process uses none, while a controller that held its own thread
back (a long garbage collection, a long tick under the interpreter's lock) used the CPU share it
was given, on a host busy enough that it got a third of a core still over three times that, and
its workers were not stopped. A process runnable but given almost no CPU that long still counts as
paused. :meth:`PauseWatch.take` also counts a pause the thread has not woken from yet, so a tick that
runs first after a resume still knows, and :meth:`PauseWatch.lost_total_s` tells a heartbeat how long
its worker was stopped since its last, whichever noticed the pause first."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

PAUSE_WATCH_INTERVAL_S = 0.5
PAUSE_THRESHOLD_S = 3.0  # later than this past its wake-up: the process did not run
PAUSED_CPU_SHARE = 0.1  # ... if it used less CPU time than this share of the lateness meanwhile


class PauseWatch:
    def __init__(self, interval_s: float = PAUSE_WATCH_INTERVAL_S, threshold_s: float = PAUSE_THRESHOLD_S,
                 clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        self.interval_s = interval_s
        self.threshold_s = threshold_s
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._lock = threading.Lock()
        self._lost_s = 0.0
        self._taken_s = 0.0  # lost and taken since the watch was made
        self._last_s = clock()
        self._last_cpu_s = cpu_clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            self._last_s, self._last_cpu_s = self._clock(), self._cpu_clock()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="pause-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def beat(self) -> None:
        """Count the lateness of this wake-up, if it is one."""
        with self._lock:
            now_s, cpu_s = self._clock(), self._cpu_clock()
            self._lost_s += self._late_s(now_s, cpu_s)
            self._last_s, self._last_cpu_s = now_s, cpu_s

    def take(self) -> float:
        """Seconds lost since the last call."""
        with self._lock:
            now_s, cpu_s = self._clock(), self._cpu_clock()
            lost_s = self._lost_s + self._late_s(now_s, cpu_s)
            self._lost_s, self._last_s, self._last_cpu_s = 0.0, now_s, cpu_s
            self._taken_s += lost_s
            return lost_s

    def lost_total_s(self) -> float:
        """Seconds lost since the watch was made, a pause not taken (or not woken from) yet included:
        read at two moments, the difference is how long the process did not run in between, whether
        or not :meth:`take` ran meanwhile."""
        with self._lock:
            return self._taken_s + self._lost_s + self._late_s(self._clock(), self._cpu_clock())

    def _late_s(self, now_s: float, cpu_s: float) -> float:
        late_s = now_s - self._last_s - self.interval_s
        if late_s <= self.threshold_s or cpu_s - self._last_cpu_s >= PAUSED_CPU_SHARE * late_s:
            return 0.0
        return late_s

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()
