"""Opening the rollout store safely: one writer at a time, no log without its index, every
record read back checked.

- **One writer.** The process that writes the payload log holds an exclusive ``flock`` on
  ``<store>.lock`` in the state directory; its syncer inherits the lock, so the lock outlives a
  killed controller for as long as its syncer still lives (a slow commit on a slow disk). A new
  store waits for it (bounded) and then fails naming the holders, rather than writing where an
  old syncer may still write. The lock file holds the holders' pids (for that message only). A
  second ``flock``, on the payload log's directory, refuses a second writer when the lock file
  was deleted under the first (:func:`lock_log_dir`).
- **No log without its index.** The index is what knows which groups were delivered; a log
  without it would hand every group in it out again. So a missing or empty index beside a log
  that holds records is refused, with what to do.
- **No index older than its log.** An index that counts fewer state transitions than the
  mark beside it (:mod:`mark`) lost some (its ``-wal`` file, or an older copy restored): refused.
- **Checked reads.** A group's body is read with its record's header and head, rebuilt from the
  index row, so a read checks that the record is that group's and its CRC holds.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path

from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts import syncer
from slurm_elastic.rollouts.index import GroupBody, StoreIndex
from slurm_elastic.rollouts.inspection import replay_start
from slurm_elastic.rollouts.mark import mark_path, read_mark
from slurm_elastic.rollouts.segments import (
    SegmentLog,
    group_head,
    json_str,
    segment_name,
    segment_numbers,
)

log = logging.getLogger(__name__)
LOCK_POLL_S = 0.05


def lock_path(path: Path) -> Path:
    return path.with_name(path.stem + ".lock")


def take_writer_lock(path: Path, wait_s: float) -> int:
    """Hold the store's writer lock (an open descriptor); waits up to ``wait_s`` for a holder
    to go, then raises StateFileError naming it."""
    where = lock_path(path)
    try:
        fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StateFileError(f"rollout store lock {where}: {exc}") from None
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holders = describe_holders(where)
            if time.monotonic() >= deadline:
                os.close(fd)
                raise StateFileError(
                    f"rollout store {path} is in use by {holders} (waited {wait_s:g} s for its lock {where}): "
                    "stop that process (an earlier controller of this job, or its syncer) and start again"
                ) from None
            if not waiting:
                log.warning("rollout store %s: waiting for %s to let go of its payload log", path, holders)
                waiting = True
            time.sleep(LOCK_POLL_S)
    note_holders(fd, syncer_pid=None)
    return fd


def lock_log_dir(path: Path, log_dir: Path, wait_s: float) -> int | None:
    """The writer's second hold: an exclusive ``flock`` on the payload log's directory (its
    syncer inherits it too), which a deleted lock file does not free: a second store opened over
    the same files then, and given the new lock file, is refused here instead of writing beside
    the first (both numbered their groups from the same arrival number, and each took the
    other's rows for its own stored already). Waits up to ``wait_s`` for a holder to go, as for
    the lock file (a writer letting go frees this lock just after that one). None, with a
    warning, where the file system takes no lock on a directory (NFS): the lock file alone
    holds there."""
    try:
        fd = os.open(log_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise StateFileError(f"rollout store payload log {log_dir}: {exc}") from None
    deadline, waiting_told = time.monotonic() + wait_s, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() < deadline:
                if not waiting_told and time.monotonic() > deadline - wait_s + 1.0:  # not a handover's instant
                    waiting_told = True
                    log.warning("rollout store %s: waiting up to %g s for the process that holds its payload log %s "
                                "to let go", path, wait_s, log_dir)
                time.sleep(LOCK_POLL_S)
                continue
            os.close(fd)
            raise StateFileError(
                f"rollout store {path} is in use: another process holds its payload log {log_dir} (an earlier "
                f"controller of this job, or its syncer) though its lock file {lock_path(path)} was free (deleted "
                f"while that process ran?); waited {wait_s:g} s: stop that process and start again") from None
        except OSError as exc:
            os.close(fd)
            log.warning("rollout store %s: the file system refuses a lock on its payload log %s (%s): only the "
                        "lock file %s keeps a second writer out (deleting it while the controller runs lets one in)",
                        path, log_dir, exc, lock_path(path))
            return None


def note_holders(fd: int, syncer_pid: int | None) -> None:
    """Write who holds the lock into the lock file (read only to name them in an error; a
    full disk that refuses it costs nothing else)."""
    text = f"controller pid {os.getpid()}\n" + (f"syncer pid {syncer_pid}\n" if syncer_pid else "")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
    except OSError as exc:
        log.warning("could not note the holders of the rollout store's lock: %s", exc)


def describe_holders(where: Path) -> str:
    try:
        lines = where.read_text().splitlines()
    except OSError:
        lines = []
    names = []
    for line in lines:
        role, _, pid = line.rpartition(" ")
        if pid.isdigit():
            names.append(f"{role} {pid}" + ("" if _alive(int(pid)) else " (gone)"))
    return ", ".join(names) or "another process"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def refuse_log_without_index(path: Path, what: str, log_dir: Path) -> None:
    """StateFileError if the log beside an index that ``what`` ("is missing", "holds no
    index") holds records."""
    segments = [n for n in segment_numbers(log_dir) if (log_dir / segment_name(n)).stat().st_size > 0]
    if segments:
        raise StateFileError(
            f"rollout store index {path} {what}, but its payload log {log_dir} holds records "
            f"({len(segments)} segment(s)): without the index every group in the log, delivered or not, would "
            f"be handed out again. Restore {path.name} (with its -wal file) if you have it; or, to start with an "
            f"empty queue and give those groups up, move {log_dir} aside")


def refuse_odd_files(path: Path, log_dir: Path) -> None:
    """StateFileError naming the store's file that is there but not a regular file (its index and
    the index's -wal and -shm files), or its payload log that is not a directory; SQLite would
    name only the index, with "disk I/O error" or "attempt to write a readonly database"."""
    for file in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        if os.path.lexists(file) and not file.is_file():
            raise StateFileError(f"rollout store file {file} is not a regular file: restore it from a copy (or, "
                                 "for a -shm file, remove it: SQLite makes it again)")
    if os.path.lexists(log_dir) and not log_dir.is_dir():
        raise StateFileError(f"rollout store payload log {log_dir} is not a directory: restore it from a copy")


def refuse_missing_segments(path: Path, live_segments: dict[int, int], log_dir: Path) -> None:
    """StateFileError if a segment the index ``path`` holds undelivered groups in is missing, or
    the whole payload log (an unmounted or moved file system): opened, those groups would be
    quarantined as lost for good, also once the files came back."""
    missing = sorted(n for n in live_segments if not (log_dir / segment_name(n)).exists())
    if not missing:
        return
    groups = sum(live_segments[n] for n in missing)
    what = (f"its payload log {log_dir} is missing" if not log_dir.exists() else
            f"{len(missing)} segment(s) of its payload log {log_dir} are missing ({', '.join(map(segment_name, missing[:5]))}"
            + (", ..." if len(missing) > 5 else "") + ")")
    touch = " ".join(str(log_dir / segment_name(n)) for n in missing)
    raise StateFileError(
        f"rollout store index {path} holds {groups} undelivered group(s) whose records are gone: {what}. Restore "
        f"them (a file system not mounted, a directory moved?); or, to give those groups up (counted as lost), "
        f"create the segments empty: mkdir -p {log_dir} && touch {touch}")


def refuse_index_behind_mark(path: Path, transitions: int, log_dir: Path) -> None:
    """StateFileError if the index counts fewer transitions than its mark (:mod:`mark`): it is
    older than the state the job reached, and would hand out again groups delivered since."""
    marked = read_mark(path)
    if marked is None or marked <= transitions:
        return
    raise StateFileError(
        f"rollout store index {path} is older than its log: it has committed {transitions} hand-outs, "
        f"acknowledgements, drops, quarantines and version publishes, its mark {mark_path(path).name} says "
        f"{marked} (its -wal file was lost, or an older copy was restored): groups delivered since would be handed "
        "out again, and staleness judged against an older policy version. Restore "
        f"the newest {path.name} with its -wal file; or, to hand those groups out again knowingly, delete "
        f"{mark_path(path)}; or, to start with an empty queue and give every group up, move {path.name} "
        f"(with its -wal and -shm files) and {log_dir} aside")


def index_log_tail(index: StoreIndex, segments: SegmentLog) -> int:
    """Index what the log holds past the index (after a crash or power loss); the highest
    arrival number now known."""
    last = index.last_row()
    max_seq = last[0] if last else 0
    segment, offset = replay_start(last[1:] if last else None)
    found = [(n, r) for n, r in segments.records_after(segment, offset) if int(r.head["seq"]) > max_seq]
    if found:
        rows = [(r.head["seq"], r.head["id"], r.head["worker_id"], r.head["n_seqs"], r.head["version"],
                 r.body_bytes, n, r.body_offset) for n, r in found]
        index.insert_recovered(rows, syncer.insert_rows_sql(1))
        max_seq = max(max_seq, *(int(r.head["seq"]) for _n, r in found))
    return max_seq


def read_body(segments: SegmentLog, body: GroupBody) -> bytes:
    """A group's body, checked (DamagedRecordError if not)."""
    g = body.group
    head = group_head(g.seq, json_str(g.id), json_str(g.worker_id), g.n_seqs, g.version)
    return segments.read_checked(body.segment, body.body_offset, g.nbytes, head)
