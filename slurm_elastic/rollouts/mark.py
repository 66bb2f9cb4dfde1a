"""The store's mark: how many hand-outs, acknowledgements, drops and quarantines the index has
committed, kept in a small file beside it (``<store>.mark``).

The index counts those transitions in its ``meta`` table, in the transaction that makes each;
after the commit the count is written over the mark's one fixed-width line. An index
that counts fewer than its mark is older than the state the job reached: its ``-wal`` file was
lost, or an older copy was restored, and it would hand out again groups delivered since. The
store refuses to open it. The mark is not fsynced: after a power cut it may lag the index (never
run ahead of it), which the rule allows; an operator's deleted ``-wal`` or restored copy leaves
it as it was.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
PREFIX = "slurm-elastic rollout store transitions "


def mark_path(store_path: Path) -> Path:
    return store_path.with_name(store_path.stem + ".mark")


def read_mark(store_path: Path) -> int | None:
    """The count the mark holds; None when there is none or it cannot be read (logged: it then
    tells nothing, and the next transition writes it again)."""
    path = mark_path(store_path)
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("rollout store mark %s is unreadable (%s): not checked this time", path, exc)
        return None
    count = text.removeprefix(PREFIX).strip()
    if not text.startswith(PREFIX) or not count.isdigit():
        log.warning("rollout store mark %s holds %r, not a count: not checked this time", path, text[:80])
        return None
    return int(count)


class MarkWriter:
    """Writes the count over the mark's one line, in place (one ``pwrite``, no fsync; the file
    is emptied when first opened)."""

    def __init__(self, store_path: Path) -> None:
        self.path = mark_path(store_path)
        self._fd: int | None = None

    def write(self, count: int) -> None:
        """The mark says ``count``; OSError if it cannot be written (the file is opened again next time)."""
        line = f"{PREFIX}{count:020d}\n".encode("ascii")  # one width: each write covers the last whole
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            if os.pwrite(self._fd, line, 0) != len(line):
                raise OSError(f"short write to {self.path}")
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_mark(store_path: Path, count: int) -> None:
    """Replace the mark with ``count`` (for tests and tools: the store keeps a :class:`MarkWriter`)."""
    writer = MarkWriter(store_path)
    try:
        writer.write(count)
    finally:
        writer.close()
