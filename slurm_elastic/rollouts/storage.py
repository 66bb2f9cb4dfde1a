"""What the rollout queue asks of durable storage, and the records it gets back.

The queue (:mod:`slurm_elastic.rollouts.queue`) and the API's routes know only this interface;
how a group's bytes reach the disk (the payload log, its syncer process, the SQLite index) is
the business of :class:`slurm_elastic.rollouts.store.RolloutStore`, its one implementation.
A group moves queued -> handed (in a batch) -> delivered (the batch was acknowledged), or
dropped (too stale), or lost (its record was damaged: quarantined, never delivered).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

from slurm_elastic.core.staleness_snapshot import StalenessSnapshot
from slurm_elastic.errors import StateFileError

T = TypeVar("T")
Then = Callable[[T, BaseException | None], None]
"""Called once with an outcome, or with the error that stood in its way (then the outcome is a
placeholder). Lighter than a Future on the hot path: no lock, no condition."""


def settle(future: Future[T] | asyncio.Future[T]) -> Then[T]:
    """A :data:`Then` that settles ``future`` (on the calling thread)."""
    def then(result: T, error: BaseException | None) -> None:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    return then


class StoreUnavailableError(StateFileError):
    """The store could not read or write (disk full, I/O error): nothing changed; try again after
    ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 2.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StoredGroup(NamedTuple):
    """A queued group's record in memory (a tuple of atoms: the garbage collector skips it)."""

    seq: int  # its arrival number
    id: str
    worker_id: str
    n_seqs: int
    version: int
    nbytes: int


class LostGroup(NamedTuple):
    """A group whose record was damaged: quarantined, never delivered."""

    id: str
    worker_id: str
    n_seqs: int
    version: int
    batch_id: str | None
    reason: str
    lost_s: float


@dataclass(frozen=True)
class Recovered:
    """What a store holds when it opens: what a queue is rebuilt from."""

    queued: list[StoredGroup]  # waiting, in arrival order
    unacked: list[tuple[str, list[StoredGroup]]]  # batches handed out, not acknowledged, oldest first
    seqs_by_state: dict[str, int]  # sequences per state
    lost: list[LostGroup]  # every group quarantined, oldest first
    lost_at_open: list[LostGroup]  # quarantined by this open's check of every live record
    staleness: StalenessSnapshot | None  # the counts saved last; None: never saved
    last_seq: int  # the highest arrival number stored
    arrived_after_snapshot: dict[str, int]  # sequences per worker in the groups stored after the snapshot
    trainer_session: int = 0  # the newest trainer registration's session; 0: none saved
    lost_told: int = 0  # how many of ``lost`` (oldest first) an acknowledged batch named to the trainer


@dataclass(frozen=True)
class Pulled:
    """Payloads read and checked for a batch, and the groups found damaged (quarantined)."""

    payloads: list[bytes]
    lost: list[LostGroup]


class RolloutStorage(Protocol):
    """Durable storage of rollout groups. Every method but :meth:`submit` is one durable step:
    it happened, or it raised and nothing changed (:class:`StoreUnavailableError`: try again)."""

    def recover(self) -> Recovered:
        """Everything a queue needs to go on where the last one stopped."""

    def submit(self, group_id: str, worker_id: str, n_seqs: int, version: int, payload: bytes,
               then: Then[int | None]) -> None:
        """Store a group; ``then`` hears its arrival number (None: that id is stored already)
        once it is durable, or the error that failed it."""

    def pull(self, batch_id: str, group_ids: list[str], now_s: float) -> Pulled:
        """Hand the groups out as batch ``batch_id``: their payloads, in order, each checked.
        If any is damaged it is quarantined and returned in ``lost``, and no batch is recorded."""

    def pull_again(self, batch_id: str) -> Pulled:
        """An unacknowledged batch's payloads again (damaged ones quarantined and left out)."""

    def ack(self, batch_id: str) -> bool | None:
        """Mark a batch delivered. None: unknown batch; False: acknowledged already."""

    def known(self, group_id: str) -> bool:
        """A group of this id was stored, in any state."""

    def drop(self, group_ids: Iterable[str]) -> None:
        """Queued groups dropped as too stale."""

    def save_staleness(self, snapshot: StalenessSnapshot) -> None:
        """Keep the queue's staleness counts (:meth:`recover` gives the last ones back)."""

    def save_trainer_session(self, session: int) -> None:
        """Keep the newest trainer registration's session (:meth:`recover` gives it back)."""

    def save_lost_told(self, count: int) -> None:
        """Keep how many lost groups, oldest first, the trainer was told of with a batch it
        acknowledged (:meth:`recover` gives it back)."""

    def close(self) -> None:
        """Finish what was submitted and let go of the files."""
