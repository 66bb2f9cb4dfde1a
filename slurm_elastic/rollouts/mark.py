"""The store's mark: how many hand-outs, acknowledgements, drops, quarantines and policy-version
moves the index has committed, kept in a small file beside it (``<store>.mark``).

The index counts those transitions in its ``meta`` table, in the transaction that makes each;
after the commit the count goes to the mark, one line written to a temporary file (fsynced when
the store fsyncs) and renamed over the mark, so the mark is always a whole old or a whole new
line, whenever the writer is killed. An index that counts fewer than its mark is older than the
state the job reached: its ``-wal`` file was lost, or an older copy was restored, and it would
hand out again groups delivered since, or judge staleness against an older version. The store
refuses to open it. The directory is not fsynced: after a power cut the rename may be lost and
the mark lag the index (never run ahead of it), which the rule allows; an operator's deleted
``-wal`` or restored copy leaves it as it was.
A missing mark checks nothing (a new store, or one from before marks); one that is there and
cannot be read is damage, and the store refuses to open until it is restored or deleted.
"""

from __future__ import annotations

import os
from contextlib import suppress
from pathlib import Path

from slurm_elastic.errors import StateFileError

PREFIX = "slurm-elastic rollout store transitions "


def mark_path(store_path: Path) -> Path:
    return store_path.with_name(store_path.stem + ".mark")


def read_mark(store_path: Path) -> int | None:
    """The count the mark holds; None when there is no mark. StateFileError, naming the file and
    what to do, when it is there but cannot be read or holds no count."""
    path = mark_path(store_path)
    try:
        text = path.read_bytes().decode("ascii")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise _damaged(path, f"it cannot be read: {exc}") from None
    count = text.removeprefix(PREFIX).strip()
    if not text.startswith(PREFIX) or not count.isdigit():
        raise _damaged(path, f"it holds {text[:80]!r}, not a count")
    return int(count)


def _damaged(path: Path, what: str) -> StateFileError:
    return StateFileError(
        f"rollout store mark {path} is damaged ({what}); it is what tells an index older than its log, so the "
        f"store does not open without it. Restore {path.name} from a copy; or, to open without that check "
        f"knowingly (an index older than its log would hand out again groups delivered since), delete {path}")


class MarkWriter:
    """Writes the count to the mark: a temporary file beside it (fsynced if ``fsync``), renamed
    over it."""

    def __init__(self, store_path: Path, fsync: bool = True) -> None:
        self.path = mark_path(store_path)
        self.fsync = fsync
        self._tmp = self.path.with_name(f".{self.path.name}.tmp")  # one writer: the store's lock holder

    def write(self, count: int) -> None:
        """The mark says ``count``, or (OSError) it says what it said before."""
        line = f"{PREFIX}{count:020d}\n".encode("ascii")
        try:
            fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                if os.write(fd, line) != len(line):
                    raise OSError(f"short write to {self._tmp}")
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self._tmp, self.path)
        except OSError:
            with suppress(OSError):
                self._tmp.unlink(missing_ok=True)
            raise


def write_mark(store_path: Path, count: int) -> None:
    """Replace the mark with ``count`` (for tests and tools: the store keeps a :class:`MarkWriter`)."""
    MarkWriter(store_path).write(count)
