"""The durable side of the rollout queue: a payload log and a SQLite index in the job's state directory.

A submitted group's body is appended to the payload log (:mod:`segments`); its row (id, worker,
size, version, state, where its body is) goes to the index (:mod:`index`, SQLite in WAL mode).
Submits are group-committed (:mod:`commits`, with the syncer process of :mod:`syncer`). Groups
move queued -> handed (in a batch) -> delivered (the trainer acknowledged the batch), or
dropped (too stale), or lost (their record was damaged: quarantined, never delivered); batches
handed out and never acknowledged are handed out again, with the same id, after a trainer or
controller restart. Batch and acknowledgement transactions are fsynced by SQLite itself; they
also make every index row written before them durable, so after a power loss the index is a
prefix of the log, and what the log holds past it is indexed again at open. Opening takes the
writer lock, looks at the index read-only (:mod:`inspection`: an index it refuses, or one older
than its mark, or a log without its index, or one with a bad record in an older segment past
the index, is left as it was), finds records the index places wrongly (:mod:`placement`: segment
files swapped or renamed), then checks every live record (:mod:`recovery`); every read checks its
record again. A segment that holds a group quarantined as lost is kept on disk.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from slurm_elastic.core.staleness_snapshot import StalenessSnapshot
from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts.commits import GroupCommits
from slurm_elastic.rollouts.index import (
    LOST_TOLD_KEY,
    STALENESS_KEY,
    SYNCHRONOUS,
    TRAINER_SESSION_KEY,
    GroupBody,
    StoreIndex,
)
from slurm_elastic.rollouts.inspection import Inspected, inspect_index
from slurm_elastic.rollouts.placement import Placement, place_records, refuse_foreign_records
from slurm_elastic.rollouts.recovery import (
    index_log_tail,
    lock_log_dir,
    read_body,
    refuse_index_behind_mark,
    refuse_log_without_index,
    refuse_missing_segments,
    refuse_odd_files,
    take_writer_lock,
)
from slurm_elastic.rollouts.segments import (
    SEGMENT_BYTES,
    DamagedRecordError,
    SegmentLog,
    segment_name,
)
from slurm_elastic.rollouts.storage import (
    LostGroup,
    Pulled,
    Recovered,
    StoredGroup,
    StoreUnavailableError,
)
from slurm_elastic.rollouts.torn import refuse_damaged_log

__all__ = ["RolloutStore", "StoreUnavailableError"]
log = logging.getLogger(__name__)
LOCK_WAIT_S = 120.0  # how long a new store waits for an earlier writer (its syncer) to go
Checked = tuple[list[tuple[GroupBody, bytes]], list[tuple[GroupBody, str]]]
"""Bodies read and checked: the good ones with their bytes, the damaged ones with the reason."""


class RolloutStore(GroupCommits):
    """The rollout store (a :class:`~slurm_elastic.rollouts.storage.RolloutStorage`).
    Thread-safe: the index behind a lock; submits group-committed (:class:`commits.GroupCommits`)."""

    def __init__(self, path: Path, fsync: str = "always", segment_bytes: int = SEGMENT_BYTES,
                 direct_io: bool = True, lock_wait_s: float = LOCK_WAIT_S,
                 clock: Callable[[], float] = time.time) -> None:
        if fsync not in SYNCHRONOUS:
            raise ValueError(f"fsync must be one of {', '.join(SYNCHRONOUS)}")
        self.path = path
        self.fsync = fsync
        self.direct_io = direct_io and fsync == "always"  # the syncer writes the log with O_DIRECT
        self.clock = clock
        self._version_saved: int | None = None  # the policy version of the last staleness save
        self._writer_lock = take_writer_lock(path, lock_wait_s)  # held (with the syncer) until close
        self._dir_lock: int | None = None  # and the payload log's directory (recovery.lock_log_dir)
        try:
            self.lost_at_open = self._open(segment_bytes, lock_wait_s)
        except BaseException:
            for fd in (self._dir_lock, self._writer_lock):
                if fd is not None:
                    os.close(fd)
            raise
        self._init_commits()

    # ---- opening ----------------------------------------------------------------------------
    def _open(self, segment_bytes: int, lock_wait_s: float) -> list[LostGroup]:
        """Check the index and the log past it read-only and refuse them (changing nothing) if the
        index is damaged, older than its mark, or missing beside a log, or an older segment past
        it holds a bad record; then open the index and the log, index the log's tail (cutting a
        torn tail off the newest segment), verify every live record (the damaged ones are
        quarantined and returned), go on appending in a new segment."""
        log_dir = self.path.with_name(self.path.stem + ".segments")
        refuse_odd_files(self.path, log_dir)
        dir_locked = log_dir.is_dir()  # else locked once SegmentLog has made it
        if dir_locked:
            self._dir_lock = lock_log_dir(self.path, log_dir, lock_wait_s)
        if not self.path.exists():
            refuse_log_without_index(self.path, "is missing", log_dir)
        found = inspect_index(self.path) if self.path.exists() else Inspected(True, 0, {})
        placed = Placement({}, {}, (0, 0), {})
        if found.fresh:
            refuse_log_without_index(self.path, "holds no index", log_dir)
        else:
            refuse_index_behind_mark(self.path, found.transitions, log_dir)
            try:
                placed = place_records(self.path, log_dir)
                refuse_damaged_log(log_dir, *placed.replay_from, placed.live_ends)
                refuse_foreign_records(self.path, log_dir, placed.replay_from)
            except OSError as exc:  # a segment this user may not read, an I/O error
                raise StateFileError(f"rollout store {self.path}: reading its payload log: {exc}") from None
            refuse_missing_segments(self.path, placed.live_segments, log_dir)
        snapshot, _session, _told = self._saved(lambda key, default: found.meta.get(key, default))
        self._version_saved = None if snapshot is None else snapshot.version
        self._index = StoreIndex(self.path, self.fsync)
        try:
            if unknown := self._index.create_schema(self.clock(), found.transitions):
                log.warning("rollout store %s: %d lost group(s) had no record of why (the index's lost table "
                            "was dropped or emptied): recorded again as lost, reason unknown", self.path, unknown)
            if found.fresh:
                self._index.reset_mark()
            if placed.moves:
                self._index.move(placed.moves)
                log.warning("rollout store %s: %d group record(s) were not where the index placed them and were "
                            "found whole in other segment files (%s): segment files swapped, renamed or copied? "
                            "The index points to them now", self.path, len(placed.moves),
                            ", ".join(sorted({segment_name(n) for n, _o in placed.moves.values()})))
            self.log = SegmentLog(log_dir, segment_bytes)
        except BaseException:
            self._index.close()
            raise
        try:
            if not dir_locked:
                self._dir_lock = lock_log_dir(self.path, log_dir, lock_wait_s)  # made just now
            return self._check_at_open()
        except BaseException:
            self._index.close()
            self.log.close()
            raise

    def _check_at_open(self) -> list[LostGroup]:
        self._next_seq = index_log_tail(self._index, self.log) + 1
        self._live: collections.Counter[int] = collections.Counter(self._index.live_per_segment())
        self._kept = self._index.lost_segments()
        _good, damaged = self._check(self._index.live_bodies())
        lost = self.quarantine(damaged) if damaged else []  # counted live first: only an emptied segment goes
        if self.log.size or damaged:  # never append where an earlier writer wrote, or the index points
            self.log.roll_over()
        kept = []
        for number in self.log.numbers():
            if not self._live[number]:
                if number in self._kept and self.log.path(number).stat().st_size:  # an empty one shows nothing
                    kept.append(segment_name(number))
                else:
                    self.log.delete(number)
        if kept:
            log.warning("rollout store %s: segment(s) %s of its payload log are kept only for groups quarantined "
                        "as lost there (never served; `slurm-elastic status` counts them): delete them once "
                        "nobody needs to look at them", self.path, ", ".join(kept))
        return lost

    def close(self) -> None:
        """Commit what is waiting, stop the syncer, close the index and the log."""
        self._close_commits()
        self._index.close()
        self.log.close()
        if self._dir_lock is not None:  # first: an opener polls the writer lock, then takes this one
            os.close(self._dir_lock)
        os.close(self._writer_lock)  # the syncer, its other holder, is gone

    def _saved(self, meta: Callable[[str, str], str]) -> tuple[StalenessSnapshot | None, int, int]:
        """The staleness counts, trainer session and count of lost groups told, from ``meta``
        (key, default); StateFileError if they cannot be read (checked at open, before writing)."""
        raw = meta(STALENESS_KEY, "")
        if not raw and meta("version", ""):
            raise StateFileError(f"rollout store {self.path} keeps the policy version without the staleness "
                                 "counts, a format this version does not read: let the trainer take every batch "
                                 "with the version that wrote it, or move the store aside")
        try:
            snapshot = StalenessSnapshot.from_json(raw) if raw else None
        except ValueError as exc:
            raise StateFileError(f"rollout store {self.path}: unreadable staleness snapshot {raw!r} ({exc})") from None
        session, told = meta(TRAINER_SESSION_KEY, "0"), meta(LOST_TOLD_KEY, "0")
        if not (session.isdigit() and told.isdigit()):
            raise StateFileError(f"rollout store {self.path}: unreadable trainer session {session!r} "
                                 f"or count of lost groups told {told!r}")
        return snapshot, int(session), int(told)

    def recover(self) -> Recovered:
        """What the store holds, for a queue to rebuild itself from."""
        snapshot, session, told = self._saved(self.get_meta)
        last_seq, arrived = self._index.arrived_since(snapshot.at_seq if snapshot else 0)
        return Recovered(self._index.queued(), self._index.unacked_batches(), self._index.counts(),
                         self._index.lost(), self.lost_at_open, snapshot, last_seq, arrived, session, told)

    def save_staleness(self, snapshot: StalenessSnapshot) -> None:
        """Keep the staleness counts; a save that moves the policy version is a transition (the
        mark counts it), so an index that lost it is refused: it would judge staleness against an
        older version and hand the trainer groups past the bound."""
        moved = snapshot.version != self._version_saved
        self.set_meta(STALENESS_KEY, snapshot.to_json(), transition=moved)
        self._version_saved = snapshot.version

    def save_trainer_session(self, session: int) -> None:
        self.set_meta(TRAINER_SESSION_KEY, str(session))

    def save_lost_told(self, count: int) -> None:
        self.set_meta(LOST_TOLD_KEY, str(count))

    # ---- reads, hand-outs, acknowledgements --------------------------------------------------
    def _check(self, bodies: list[GroupBody]) -> Checked:
        """Read each body with its record and check it."""
        good: list[tuple[GroupBody, bytes]] = []
        damaged: list[tuple[GroupBody, str]] = []
        for body in bodies:
            try:
                good.append((body, read_body(self.log, body)))
            except DamagedRecordError as exc:
                damaged.append((body, str(exc)))
            except OSError as exc:
                raise StoreUnavailableError(f"rollout store {self.path}: reading the payload log: {exc}") from None
        return good, damaged

    def read_checked(self, group_ids: list[str]) -> Checked:
        """The groups' bodies, in the given order, each checked against its record's CRC."""
        return self._check(self._index.bodies(group_ids)) if group_ids else ([], [])

    def batch_checked(self, batch_id: str) -> Checked:
        """A batch's bodies (groups lost already left out), in arrival order, checked."""
        return self._check(self._index.batch_bodies(batch_id))

    def quarantine(self, damaged: list[tuple[GroupBody, str]]) -> list[LostGroup]:
        """Record damaged groups as lost (durably), out of the live states; logged."""
        now_s = self.clock()
        freed = self._index.quarantine(damaged, now_s)
        self._kept.update(b.segment for b, _r in damaged)  # kept on disk, never deleted by the store
        with self._index.lock:
            self._release(freed)
        lost = []
        for body, reason in damaged:
            g = body.group
            log.error("rollout group %s (worker %s, version %d, %d sequences) is damaged in the payload log "
                      "(%s): quarantined as lost, never delivered", g.id, g.worker_id, g.version, g.n_seqs, reason)
            lost.append(LostGroup(g.id, g.worker_id, g.n_seqs, g.version, None, reason, now_s))
        return lost

    def pull(self, batch_id: str, group_ids: list[str], now_s: float) -> Pulled:
        """The groups' payloads, checked, and the batch recorded (one transaction); if any is
        damaged, it is quarantined and returned in ``lost`` and no batch is recorded."""
        good, damaged = self.read_checked(group_ids)
        if damaged:
            return Pulled([], self.quarantine(damaged))
        self._index.hand_out(batch_id, group_ids, now_s)
        return Pulled([p for _b, p in good], [])

    def pull_again(self, batch_id: str) -> Pulled:
        """A batch's payloads again, checked; damaged ones quarantined and left out."""
        good, damaged = self.batch_checked(batch_id)
        return Pulled([p for _b, p in good], self.quarantine(damaged) if damaged else [])

    def hand_out(self, batch_id: str, group_ids: list[str], now_s: float) -> list[bytes]:
        """Check the groups' bodies, quarantine the damaged ones, record the batch of the others
        and return their payloads (in the given order)."""
        good, damaged = self.read_checked(group_ids)
        if damaged:
            self.quarantine(damaged)
        self._index.hand_out(batch_id, [b.group.id for b, _p in good], now_s)
        return [p for _b, p in good]

    def batch_payloads(self, batch_id: str) -> list[tuple[str, bytes]]:
        """A batch's groups and payloads, checked; damaged ones quarantined and left out."""
        good, damaged = self.batch_checked(batch_id)
        if damaged:
            self.quarantine(damaged)
        return [(b.group.id, p) for b, p in good]

    def ack(self, batch_id: str) -> bool | None:
        """Mark a batch delivered. None: unknown batch; False: it was already acknowledged."""
        result, freed = self._index.ack(batch_id)
        with self._index.lock:
            self._release(freed)
        return result

    def drop(self, group_ids: Iterable[str]) -> None:
        """Queued groups dropped as too stale."""
        freed = self._index.drop(group_ids)
        with self._index.lock:
            self._release(freed)

    def _release(self, freed: list[tuple[int, int]]) -> None:
        """Groups left the live states (index lock held): delete segments nobody needs any more."""
        for segment, n in freed:
            self._live[segment] -= n
            if self._live[segment] <= 0:
                del self._live[segment]
                if segment not in self._kept:
                    self.log.delete(segment)

    def queued(self) -> list[StoredGroup]:
        """Groups waiting, in arrival order (for a restart)."""
        return self._index.queued()

    def known(self, group_id: str) -> bool:
        """A group of this id was stored (queued, handed out, delivered, dropped or lost)."""
        return self._index.known(group_id)

    def counts(self) -> dict[str, int]:
        """Sequences per state (for status after a restart)."""
        return self._index.counts()

    def lost(self) -> list[LostGroup]:
        """Every group quarantined as lost, oldest first."""
        return self._index.lost()

    def get_meta(self, key: str, default: str = "") -> str:
        return self._index.get_meta(key, default)

    def set_meta(self, key: str, value: str, transition: bool = False) -> None:
        self._index.set_meta(key, value, transition)
