"""What the step wrapper's loop sleeps on: a self-pipe that signals and the command's exit write to.

``signal.set_wakeup_fd`` makes every signal write a byte to the pipe (the Python handlers still
run and set the wrapper's flags), and a thread blocked in ``wait()`` on the command writes one
when it exits, so the loop sleeps until something happened or its next heartbeat is due instead
of waking every few milliseconds to look.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading


class Wakeup:
    """A self-pipe: :meth:`poke` (or a signal, once :meth:`watch_signals` ran) ends :meth:`wait`."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._previous_fd: int | None = None

    def watch_signals(self) -> None:
        """Signals wake :meth:`wait` (main thread only; elsewhere signals are not handled anyway)."""
        if threading.current_thread() is threading.main_thread():
            self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)

    def watch_exit(self, child: subprocess.Popen[bytes]) -> None:
        """Wake :meth:`wait` when ``child`` exits."""
        def wait_for_exit() -> None:
            child.wait()
            self.poke()

        threading.Thread(target=wait_for_exit, name="child-exit", daemon=True).start()

    def poke(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            os.write(self._write_fd, b"\0")

    def wait(self, timeout_s: float) -> None:
        """Until poked, a signal or ``timeout_s``; then forget what woke it."""
        select.select([self._read_fd], [], [], max(0.0, timeout_s))
        try:
            while os.read(self._read_fd, 512):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self._previous_fd is not None:
            signal.set_wakeup_fd(self._previous_fd)
            self._previous_fd = None
        os.close(self._read_fd)
        os.close(self._write_fd)
