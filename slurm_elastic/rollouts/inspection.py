"""Looking at the rollout store's index before it is opened for writing, without writing anything.

Every check that can refuse an existing index at open runs here, on a read-only connection, so a
refused index is left byte for byte as it was, ``-wal`` and ``-shm`` files included: what the
refusal tells the operator to restore is still there. (A read-write connection rebuilds the
``-shm`` file, and the last one to close checkpoints the readable part of the ``-wal`` into the
index and deletes it.)
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import NamedTuple

from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.index import (
    LIVE_STATES,
    NOT_WRITTEN_HERE,
    STALENESS_KEY,
    TRANSITIONS_KEY,
    disk_full_hint,
)


class Inspected(NamedTuple):
    """What a read-only look at the index found: no tables yet, its count of transitions, its
    ``meta`` rows, where replaying the log past it starts (:func:`replay_start`), and how many
    undelivered groups it holds in each segment."""

    fresh: bool
    transitions: int
    meta: dict[str, str]
    replay_from: tuple[int, int] = (0, 0)
    live_segments: dict[int, int] = {}


LAST_PLACE_SQL = "SELECT segment, body_offset, nbytes FROM groups ORDER BY seq DESC LIMIT 1"


def replay_start(last: tuple[int | None, int | None, int] | None) -> tuple[int, int]:
    """Where the log's records past the index start: just past the body of its newest row
    (``last``: segment, body offset, size), or the log's start if it has none or no place."""
    if last is None or last[0] is None:
        return 0, 0
    return int(last[0]), int(last[1] or 0) + int(last[2])


@contextmanager
def read_only(path: Path) -> Iterator[sqlite3.Connection]:
    """A connection to the index that writes nothing: not the index, its ``-wal`` or its ``-shm``.
    With a ``-wal`` file SQLite reads through it and keeps the wal-index in memory
    (``readonly_shm``: SQLite would otherwise rebuild the ``-shm`` file, and the last connection
    to close would checkpoint the ``-wal`` into the index and delete it); an empty ``-shm`` is
    made for that when there is none, and removed after. Without a ``-wal`` file the index file
    is the whole index (``immutable``: nothing is made)."""
    wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
    made_shm = wal.exists() and not shm.exists()
    if made_shm:
        shm.touch(mode=0o600, exist_ok=False)
    try:
        how = "readonly_shm=1" if wal.exists() else "immutable=1"
        with closing(sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro&{how}", uri=True,
                                     isolation_level=None)) as db:
            yield db
    finally:
        if made_shm:
            shm.unlink(missing_ok=True)


def inspect_index(path: Path) -> Inspected:
    """Every check of an existing index that can refuse it, read-only (:func:`read_only`):
    SQLite's own check of its pages, a format this version does not read, rows it never writes,
    a lost ``meta`` table, a damaged count of transitions (StateFileError, saying what to do);
    and where replaying the log past it starts."""
    try:
        with read_only(path) as db:
            if db.execute("SELECT 1 FROM sqlite_master WHERE name='groups'").fetchone() is None:
                return Inspected(True, 0, {})
            if (damage := db.execute("PRAGMA quick_check(1)").fetchone()[0]) != "ok":
                raise StateFileError(f"rollout store {path} is damaged: SQLite's check of it says {damage!r}; "
                                     f"{RESTORE.format(name=path.name)}")
            _refuse_old_format(db, path)
            _refuse_foreign_rows(db, path)
            has_meta = db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone()
            meta = {str(k): str(v) for k, v in db.execute("SELECT key, value FROM meta")} if has_meta else None
            _refuse_lost_meta(db, path, meta)
            live = db.execute(f"SELECT segment, COUNT(*) FROM groups WHERE state IN {LIVE_STATES} "
                              "AND segment IS NOT NULL GROUP BY segment")
            return Inspected(False, _committed_transitions(meta or {}, path), meta or {},
                             replay_start(db.execute(LAST_PLACE_SQL).fetchone()), {int(n): int(k) for n, k in live})
    except sqlite3.DatabaseError as exc:
        raise StateFileError(f"rollout store {path} is unusable: {exc}") from None
    except OSError as exc:  # the -shm file could not be made
        raise StateFileError(f"rollout store {path} is unusable: {exc}{disk_full_hint(path)}") from None


RESTORE = ("restore the store from a copy, or move {name} and its segments aside to start with an empty queue")


def _refuse_old_format(db: sqlite3.Connection, path: Path) -> None:
    """StateFileError if the index's rows hold no place in the payload log (group bodies inside it)."""
    columns = {r[1] for r in db.execute("PRAGMA table_info(groups)")}
    if not {"segment", "body_offset"} <= columns or db.execute(
            f"SELECT 1 FROM groups WHERE state IN {LIVE_STATES} AND segment IS NULL LIMIT 1").fetchone():
        raise StateFileError(
            f"rollout store {path} keeps group bodies inside its index, a format this version does "
            "not read: let the trainer take every batch with the version that wrote it, or move the "
            "store aside to start with an empty queue")


def _refuse_foreign_rows(db: sqlite3.Connection, path: Path) -> None:
    """StateFileError naming the first row of the index that this version never writes: the
    index was edited or damaged, and its queue cannot be trusted (such rows were skipped
    unreported, or stopped the controller with a traceback)."""
    n_rows, first = db.execute(f"SELECT COUNT(*), MIN(seq) FROM groups WHERE {NOT_WRITTEN_HERE}").fetchone()
    if n_rows:
        row = db.execute("SELECT seq, quote(id), quote(state), quote(n_seqs), quote(version), quote(batch_id) "
                         "FROM groups WHERE seq = ?", (first,)).fetchone()
        raise StateFileError(
            f"rollout store {path} is damaged: {n_rows} group row(s) hold what this version never writes "
            f"(the first: arrival {row[0]}, id {row[1]}, state {row[2]}, n_seqs {row[3]}, version {row[4]}, "
            f"batch {row[5]}); {RESTORE.format(name=path.name)}")


def _refuse_lost_meta(db: sqlite3.Connection, path: Path, meta: dict[str, str] | None) -> None:
    """StateFileError if the ``meta`` table's staleness row (the policy version and staleness
    counts) is gone while groups of a policy version above 0 are stored: the version would
    silently start again at 0 (and every group would read as made past it). A version above
    0 is saved in that row before any group of it is accepted. Every open writes
    :data:`MARKER_KEY`; an index from before that with no staleness row never had a
    published version. ``meta``: its rows (None: no such table)."""
    has_meta, keys = meta is not None, set(meta or ())
    if STALENESS_KEY in keys:
        return
    top_version, n_rows = db.execute("SELECT COALESCE(MAX(version), 0), COUNT(*) FROM groups").fetchone()
    if top_version > 0 or (n_rows and not has_meta):
        state = "gone" if not has_meta else ("empty" if not keys else "without its staleness row")
        raise StateFileError(
            f"rollout store {path} is damaged: its meta table, which holds the policy version and the "
            f"staleness counts, is {state} while it stores {n_rows} group(s) "
            f"of policy versions up to {top_version}: the version would start again at 0; "
            f"{RESTORE.format(name=path.name)}")


def _committed_transitions(meta: dict[str, str], path: Path) -> int:
    raw = meta.get(TRANSITIONS_KEY)
    if raw is None:
        return 0  # an index written before the count was kept, or a new one
    if not raw.isdigit():
        raise StateFileError(f"rollout store {path} is damaged: its count of transitions is {raw!r}, "
                             f"not a count; {RESTORE.format(name=path.name)}")
    return int(raw)
