"""The trainer's side of the rollout queue.

    from slurm_elastic.trainer import Trainer

    trainer = Trainer.from_env()                 # registers: unacknowledged batches come first
    for batch in trainer.batches():              # waits while fewer than batch_size are buffered
        update_policy(batch.groups)
        trainer.ack(batch)                       # only now are these rollouts "delivered"
        trainer.publish_version(step)            # frees staleness capacity for the workers
        # server workers: trainer.publish_version(step, weights="/shared/ckpt/step-N") pushes them too,
        # and trainer.wait_for_weights(step) waits until a server runs them (or says why none does)

After resuming from a checkpoint at version V, call ``publish_version(V, recovered=True)``: the
staleness capacity is then one window less what is still buffered, not inflated by V, and groups
still buffered that were made past V (by the weights of the run it went back from) are dropped,
not delivered: queued ones, and those of a batch handed out again (same id, without them). A plain
publish may not go below the current version nor more than ``max_staleness + 1`` past it (an
``ApiError`` with status 409 that names ``recovered=true``). A batch that was handed out but never
acknowledged (the trainer or the controller died) is handed out again with the same id, so a
trainer that remembers acknowledged ids processes every rollout exactly once; one it still
holds (prefetched, not yet acknowledged) is skipped. A pull whose answer is lost is retried with
the same ``pull_id``, which gets that same batch. One ``Trainer`` per job (on one rank): each
registration is taken as the trainer's restart and gets every unacknowledged batch again, and
the calls of a ``Trainer`` registered before it are refused from then on
(:class:`~slurm_elastic.errors.TrainerSupersededError`, an ``ApiError`` 409): a second live
trainer fails loudly instead of sharing the batches.

A group whose stored copy was found damaged is never delivered: the controller quarantines it
and names it in the next batch (``lost_group_ids``; again with that batch until it is
acknowledged). The trainer logs a warning, keeps the ids in ``Trainer.lost_group_ids`` and
calls ``on_lost(ids)`` if given, once per id. A batch handed out again
keeps its id without the groups lost since. While the controller's disk is full (503) the
trainer waits and asks again. A refused token (401, 403; also another job's controller on the
old address while this job's restarts) is asked again, the controller's address read again each
time, as long as an unreachable controller is waited for; then
:class:`~slurm_elastic.errors.TokenRefusedError`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_elastic.client.control import ControlClient
from slurm_elastic.client.files import stopped_by_operator_at
from slurm_elastic.client.follow import FollowedClient
from slurm_elastic.client.refusals import (
    REFUSED_LOG_S,
    RESTART_WAIT_S,
    TokenRefusals,
    is_token_refusal,
)
from slurm_elastic.errors import (
    ApiError,
    ControllerStoppedError,
    ControllerUnreachableError,
    SlurmElasticError,
    TokenRefusedError,
)
from slurm_elastic.rollouts.wire import unpack_group

log = logging.getLogger(__name__)
UNAVAILABLE = 503  # the controller's store could not write (disk full): nothing changed, ask again
WAITING_LOG_S = 60.0  # a pull that finds no batch this long says why, and again each this long


class WeightsNotLoadedError(SlurmElasticError):
    """Fewer servers than asked run the published weights in time (:meth:`Trainer.wait_for_weights`)."""


@dataclass(frozen=True)
class Batch:
    batch_id: str
    groups: list[dict[str, Any]]
    lost_group_ids: tuple[str, ...] = ()  # quarantined since the previous batch: never delivered

    @property
    def sequences(self) -> int:
        return sum(int(g["group_size"]) for g in self.groups)


class Trainer:
    """Pulls batches, acknowledges them, publishes versions; follows the controller across restarts."""

    def __init__(self, url: str, token: str, state_dir: Path | None = None, trainer_id: str = "trainer",
                 poll_s: float = 0.2, on_lost: Callable[[list[str]], None] | None = None,
                 token_source: str = "") -> None:
        self.token, self.state_dir, self.trainer_id, self.poll_s = token, state_dir, trainer_id, poll_s
        self.token_source = token_source  # where the token came from: said if the controller refuses it
        self._line = FollowedClient(url, token, state_dir, ControlClient, close_replaced=True)
        self.acked: set[str] = set()
        self.held: set[str] = set()  # batches returned to the caller and not yet acknowledged
        self.lost_group_ids: list[str] = []  # every group the controller reported lost
        self.on_lost = on_lost
        self._unreachable_logged_s = self._refused_logged_s = float("-inf")
        self._closed = False
        self._waiting_told_s = float("-inf")
        self._pull_id = uuid.uuid4().hex  # kept until a batch arrives: a pull whose answer was lost asks again
        self._refusals = TokenRefusals(token_source)  # token refusals in a row, across calls (short next_batch ones)
        self.info = self._retry(lambda: self.client.trainer_register(trainer_id))
        self.session: int | None = self.info.get("trainer_session")  # None: a controller that fences none

    @property
    def client(self) -> ControlClient:
        """The client of the controller's current address (a restart's new one once
        ``controller.json`` names it)."""
        return self._line.client

    @client.setter
    def client(self, client: ControlClient) -> None:
        self._line.client = client

    @classmethod
    def from_env(cls, **kwargs: Any) -> Trainer:
        """Inside the job: the controller is found from ``SLURM_JOB_ID`` alone, or from the variables
        :func:`~slurm_elastic.client.locate.controller_from_env` reads."""
        from slurm_elastic.client.locate import controller_from_env

        where = controller_from_env()
        return cls(where.url, where.token, where.state_dir, **{"token_source": where.token_source, **kwargs})

    def _retry(self, call: Any, timeout_s: float = RESTART_WAIT_S) -> Any:
        """``call()``, through a controller restart (its URL read again), for up to ``timeout_s``;
        then its ControllerUnreachableError or ApiError (503) is raised. A controller that
        ``controller.json`` says was stopped raises :class:`ControllerStoppedError` at once (also
        when another job's controller on its old address refuses the token). A refused token
        (401, 403) is tried again, the URL read again each time and the refusal logged once a
        minute, until ``timeout_s`` or the refusals in a row (this call's and the calls' before,
        until one ends otherwise) have gone on as long as
        :class:`~slurm_elastic.client.refusals.TokenRefusals` allows (a restart's scale): then
        :class:`~slurm_elastic.errors.TokenRefusedError` (an ApiError)."""
        if self._closed:
            raise RuntimeError("Trainer used after close(): its line to the controller is closed (make a new "
                               "Trainer: it registers again, and the batches this one held come to it)")
        deadline = time.monotonic() + timeout_s
        refusals = self._refusals
        while True:
            try:
                result = call()
            except (ControllerUnreachableError, ApiError) as exc:
                refused = is_token_refusal(exc)
                if not refused:
                    refusals.reset()  # the refusals counted are those in a row
                if (refused or isinstance(exc, ControllerUnreachableError)) and self.state_dir \
                        and (stopped_s := stopped_by_operator_at(self.state_dir)) is not None:
                    raise ControllerStoppedError(
                        f"the job's controller was stopped (slurm-elastic stop, {time.ctime(stopped_s)}): "
                        "no more batches will come") from None
                if is_token_refusal(exc):
                    url = self.client.url
                    refusals.refused(exc, url)  # raises once they went on long enough
                    if time.monotonic() > deadline:  # the caller's deadline before another try (next_batch: None)
                        raise refusals.error(exc, url) from None
                    if time.monotonic() - self._refused_logged_s >= REFUSED_LOG_S:
                        self._refused_logged_s = time.monotonic()
                        log.warning("%s", refusals.warning(exc, url))
                    self._line.refresh(force=True)  # another job's controller on the old port: ours moved?
                    time.sleep(0.5)
                    continue
                if time.monotonic() > deadline or (isinstance(exc, ApiError) and exc.status_code != UNAVAILABLE):
                    raise
                if isinstance(exc, ControllerUnreachableError) and time.monotonic() - self._unreachable_logged_s >= 60:
                    self._unreachable_logged_s = time.monotonic()
                    log.warning("%s; waiting for it (a restart: its address is read again)", exc)
                if isinstance(exc, ControllerUnreachableError):  # a 503 came from the controller in use
                    self._line.refresh(force=True)
                time.sleep(0.5)
            else:
                refusals.reset()
                return result

    def next_batch(self, timeout_s: float = 3600.0) -> Batch | None:
        """The next batch not yet acknowledged or held by this trainer (None after ``timeout_s``,
        also while the controller stays unreachable, or its address refuses the token, that long;
        refused for longer than a restart takes: TokenRefusedError). Each
        pull carries a ``pull_id`` that its retries repeat, so a batch whose answer was lost
        (a timeout, a dropped connection) comes back to the retry instead of waiting for a
        re-registration; the id changes only once a batch has arrived, so a call that returned
        None before the answer came (a short ``timeout_s``) leaves the next call asking for it."""
        started_s = time.monotonic()
        deadline = started_s + timeout_s
        while time.monotonic() < deadline:
            try:
                got = self._retry(lambda: self.client.pull_batch(self._pull_id, self.session),
                                  timeout_s=max(0.0, deadline - time.monotonic()))
            except ControllerUnreachableError:
                return None  # still down at the deadline; the next call repeats this pull's id
            except TokenRefusedError:
                if self._refusals.spent():  # refused a restart's length, over this call and those before
                    raise
                return None  # refused until the deadline (a restart, perhaps): as for one unreachable
            if got is None:
                self._tell_waiting(time.monotonic() - started_s)
                time.sleep(self.poll_s)
                continue
            self._pull_id = uuid.uuid4().hex
            lost = [str(g) for g in got.get("lost_group_ids") or []]
            new_lost = [g for g in lost if g not in self.lost_group_ids]  # named again until the ack
            if new_lost:
                self._lost(new_lost)
            if got["batch_id"] in self.acked:  # handed out again after a restart: already consumed
                batch_id = got["batch_id"]
                self._retry(lambda: self.client.ack_batch(batch_id, self.session))  # noqa: B023 (called at once)
                continue
            if got["batch_id"] in self.held:  # handed out again after a restart: this trainer holds it
                continue
            self.held.add(got["batch_id"])
            return Batch(got["batch_id"], [unpack_group(g) for g in got["groups"]], tuple(lost))  # lists again
        return None

    def _tell_waiting(self, waited_s: float) -> None:
        """After WAITING_LOG_S without a batch (and each WAITING_LOG_S after), log why, from the
        controller's numbers: a warning for a batch's worth whose whole groups make no exact batch
        (group sizes that do not divide the batch size), for a staleness bound that lets nothing
        start after more batches than versions published, or for no worker active or starting (named
        as the drain before the job's time limit when it is that); else
        (rollouts on their way, a slow step or a warm-up) the queued count and the workers, at INFO."""
        now_s = time.monotonic()
        if waited_s < WAITING_LOG_S or now_s - self._waiting_told_s < WAITING_LOG_S:
            return
        self._waiting_told_s = now_s
        try:
            numbers = self.client.global_status()
            queued, batch, active = (int(numbers["queue_size"]), int(numbers["batch_size"]),
                                     int(numbers["connected_workers"]))
            starting = int((numbers.get("workers_by_state") or {}).get("STARTING", 0))
            room, version = int(numbers.get("staleness_capacity", 1)), int(numbers.get("current_step", 0))
            taken = int(numbers.get("total_processed", 0)) // max(1, batch)
            view = numbers.get("controller") or {}
            end_drain = (view.get("last_decision") or {}).get("action") == "drain"
            limit_in_s = view.get("time_limit_in_s")
        except (SlurmElasticError, KeyError, TypeError, ValueError, AttributeError):
            return
        if queued >= batch:  # a mistake to fix: said as a warning
            log.warning("no batch for %.0f s: %d sequences are queued, a batch's worth, but no whole groups among "
                        "them make exactly %d (queue.batch_size): group sizes that do not divide it? (the "
                        "controller's log names the sizes queued)", waited_s, queued, batch)
        elif room <= 0 and taken > version + 1:  # the bound holds every rollout back: versions not published
            log.warning("no batch for %.0f s: %d of the %d sequences a batch needs are queued and the staleness bound "
                        "lets no rollout start: this trainer took %d batches but published version %d. Does it call "
                        "publish_version after each step?", waited_s, queued, batch, taken, version)
        elif active + starting == 0 and end_drain:  # the job's end is near: not a fault of the run
            left = f" ({limit_in_s:.0f} s away)" if isinstance(limit_in_s, int | float) else ""
            log.warning("no batch for %.0f s: %d of the %d sequences a batch needs are queued, and no worker runs: "
                        "every worker drained before the job's time limit%s (workers.end_drain_s); a raised "
                        "limit (scontrol update JobId=... TimeLimit=...) brings them back", waited_s, queued,
                        batch, left)
        elif active + starting == 0:
            log.warning("no batch for %.0f s: %d of the %d sequences a batch needs are queued, and no worker is "
                        "active or starting", waited_s, queued, batch)
        else:  # rollouts on their way (a slow step, a warm-up): said, not warned of
            log.info("no batch for %.0f s: %d of the %d sequences a batch needs are queued; %d worker(s) active, "
                     "%d starting", waited_s, queued, batch, active, starting)

    def _lost(self, ids: list[str]) -> None:
        log.warning("the controller lost %d rollout group(s), damaged on its disk and never delivered: %s",
                    len(ids), ", ".join(ids))
        self.lost_group_ids.extend(ids)
        if self.on_lost is not None:
            self.on_lost(ids)

    def batches(self) -> Iterator[Batch]:
        """Every batch, as it comes: waits as long as it takes (a wait over an hour is logged);
        ends with :class:`ControllerStoppedError` once the job's controller was stopped."""
        while True:
            batch = self.next_batch()
            if batch is None:
                log.warning("no batch for an hour: still waiting (workers pending in Slurm, or none running?)")
                continue
            yield batch

    def ack(self, batch: Batch) -> None:
        self._retry(lambda: self.client.ack_batch(batch.batch_id, self.session))
        self.acked.add(batch.batch_id)
        self.held.discard(batch.batch_id)

    def publish_version(self, version: int, recovered: bool = False, weights: str | None = None) -> dict[str, Any]:
        """The new policy version (``recovered=True`` after resuming from a checkpoint at it);
        answers the version and the staleness capacity. ``weights``: where this version's weights
        are (a path on the shared filesystem, or an engine-specific reference); the controller
        keeps it and pushes it to every server worker (docs/servers.md). Raises ApiError (409) for
        a plain publish lower than the current version or more than ``max_staleness + 1`` past
        it, (422) for ``weights`` empty, over 4096 characters or with control characters;
        TrainerSupersededError once another Trainer registered on the job."""
        result: dict[str, Any] = self._retry(lambda: self.client.set_version(version, recovered, weights,
                                                                             self.session))
        return result

    def wait_for_weights(self, version: int, servers: int = 1, timeout_s: float = 600.0,
                         poll_s: float = 1.0) -> int:
        """Block until ``servers`` ACTIVE server workers run the published ``version`` (every one
        that runs, if fewer do); returns how many run it. A publish is answered once kept, before
        any server loaded it: this says whether any could. WeightsNotLoadedError, naming each
        server's last update error, when ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            active = [w for w in self.status()["controller"].get("workers", [])
                      if w.get("state") == "ACTIVE" and w.get("endpoint")]
            loaded = sum(1 for w in active if w.get("weights_version") == version)
            if active and loaded >= min(servers, len(active)):
                return loaded
            if time.monotonic() >= deadline:
                errors = "; ".join(f"{w['worker_id']}: {w['weights_update_error']}" for w in active
                                   if w.get("weights_update_error")) or "no update error reported"
                raise WeightsNotLoadedError(
                    f"{loaded} of {len(active)} active servers run weights version {version} after "
                    f"{timeout_s:g} s ({servers} wanted): {errors}")
            time.sleep(poll_s)

    def status(self) -> dict[str, Any]:
        """The controller's ``/global-status``, waiting through a controller restart like every call here."""
        result: dict[str, Any] = self._retry(lambda: self.client.global_status())
        return result

    def time_limit_in_s(self) -> float | None:
        """Seconds until the job's time limit as the controller last read it from Slurm (None: the job
        has none). Every worker drains ``workers.end_drain_s`` before it, so a trainer that
        checkpoints when this runs low loses no rollout and no step."""
        left = self.status()["controller"].get("time_limit_in_s")
        return None if left is None else float(left)

    def close(self) -> None:
        """Close the line to the controller; the trainer's calls raise RuntimeError from then."""
        self._closed = True
        self._line.close()
