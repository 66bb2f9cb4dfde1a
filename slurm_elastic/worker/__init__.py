"""The worker SDK: a few lines turn a Python rollout loop into a drain-safe slurm-elastic worker.

    from slurm_elastic.worker import RolloutWorker

    with RolloutWorker.from_env() as worker:
        while not worker.draining:          # SIGUSR1 (the drain signal) only sets this flag
            if worker.admit(8) < 8:         # the staleness gate: fewer only when a drain ended the wait
                continue
            with worker.rollout():          # marks the worker busy while a rollout is in flight
                group = generate_and_score()
            worker.submit(group)            # durable hand-over; waits while the buffer is full
    # leaving the block reports a clean exit; the process exits 0

Run it under ``slurm-elastic worker -- python my_worker.py`` (the controller does this), which
registers the step, heart-beats and forwards the drain signal; the SDK adds busy/rollout
counts to the heartbeats so the controller drains idle workers first.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

from slurm_elastic.client.answers import stored_by_an_earlier_try
from slurm_elastic.client.refusals import REFUSED_LOG_S, TokenRefusals, is_token_refusal
from slurm_elastic.errors import (
    ApiError,
    ControllerUnreachableError,
    UnknownOnControllerError,
)
from slurm_elastic.rollouts.wire import group_json, pack_group
from slurm_elastic.worker.context import StepContext
from slurm_elastic.worker.control import FollowingControl
from slurm_elastic.worker.heartbeats import Heartbeats

SUBMIT_TRY_S = 5.0  # one submit's own retries, before the controller's URL is read again
UNREACHABLE_LOG_S = 60.0  # a controller that does not answer is logged this often
UNKNOWN_WAIT_S = 30.0  # a controller that does not know this worker is asked again this long (a restart without state)

if TYPE_CHECKING:  # imported when a worker is made: the step wrapper imports this package without httpx
    from slurm_elastic.client.control import ControlClient

__all__ = ["RolloutWorker", "StepContext"]
log = logging.getLogger(__name__)


class RolloutWorker:
    """Drain flag, busy marker and background heartbeats for one worker step."""

    def __init__(self, ctx: StepContext, control: FollowingControl[ControlClient] | None = None) -> None:
        from slurm_elastic.client.control import ControlClient

        self.ctx = ctx
        self.control = control or FollowingControl(ctx.worker_id, ctx.controller_url, ctx.token, ctx.state_dir,
                                                   connect=ControlClient)
        self._drain = threading.Event()
        self._over_bound_told = False  # a waiting ask over the most that may run at once was logged
        self._busy = False
        self._busy_s = 0.0  # seconds inside finished rollouts
        self._rollout_since: float | None = None  # monotonic start of the rollout in flight
        self.rollouts = 0
        self.beats = Heartbeats(ctx, self.control, self._counts, self._drain)
        self._started = self._closed = self._told_not_started = False

    @classmethod
    def from_env(cls) -> RolloutWorker:
        """From the environment the controller gives a worker step."""
        return cls(StepContext.from_env())

    @property
    def draining(self) -> bool:
        """True once a drain was asked for: finish the current rollout, hand it over, return."""
        return self._drain.is_set()

    def request_drain(self) -> None:
        self._drain.set()

    def start(self) -> RolloutWorker:
        """Install the drain-signal handler (call it from the main thread) and start the heartbeats
        (on their own thread, the first after one heartbeat interval: start() does not wait for the
        controller); ``with RolloutWorker.from_env() as worker:`` does it. Once only. Should it fail, the
        handler before is put back and the line to the controller closed."""
        if self._closed or self._started:
            raise RuntimeError(f"RolloutWorker.start: this worker was already {'closed' if self._closed else 'started'}")

        def on_drain(_signum: int, _frame: object) -> None:
            self._drain.set()  # only set a flag: the loop acts on it

        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(f"RolloutWorker.start from thread {threading.current_thread().name!r}: it installs the "
                               f"{self.ctx.drain_signal} handler, which only the main thread can; start the worker "
                               "there (its admit, submit and give_back may then be called from any thread)")
        before = signal.signal(self.ctx.drain_signum, on_drain)  # before the first beat: a drain only sets the flag
        try:
            self.beats.start()
        except BaseException:
            signal.signal(self.ctx.drain_signum, signal.SIG_DFL if before is None else before)
            self.close()
            raise
        self._started = True
        return self

    def _usable(self, method: str) -> None:
        """Refuse a call after :meth:`close`; warn once of one before :meth:`start`."""
        if self._closed:
            raise RuntimeError(f"RolloutWorker.{method} after close(): its line to the controller is closed "
                               "(call it inside the `with RolloutWorker.from_env() as worker:` block)")
        if not self._started and not self._told_not_started:
            self._told_not_started = True
            log.warning("RolloutWorker.%s before start(): no drain-signal handler is installed (the drain signal "
                        "%s ends this process, and the rollout in flight with it) and no busy time or rollout "
                        "count reaches the controller; use `with RolloutWorker.from_env() as worker:`",
                        method, self.ctx.drain_signal)

    @contextlib.contextmanager
    def rollout(self) -> Iterator[None]:
        """Mark a rollout in flight (the controller drains idle workers before busy ones; the time
        inside is the busy time the autoscaler divides production by)."""
        self._busy, self._rollout_since = True, time.monotonic()
        try:
            yield
            self.rollouts += 1
        finally:
            self._busy_s += time.monotonic() - self._rollout_since
            self._busy, self._rollout_since = False, None

    @property
    def busy_s(self) -> float:
        """Seconds spent inside :meth:`rollout` so far, the rollout in flight included."""
        since = self._rollout_since
        return self._busy_s + (0.0 if since is None else time.monotonic() - since)

    def _counts(self) -> dict[str, Any]:
        """What a heartbeat says of this worker's rollouts."""
        return {"busy": self._busy, "rollouts": self.rollouts, "busy_s": round(self.busy_s, 3)}

    def admit(self, sequences: int, wait: bool = True, poll_s: float = 0.2) -> int:
        """The staleness gate: block (unless ``wait`` is False) until ``sequences`` may start.
        What is granted is this worker's lease: its next submits use it; unused, it is released
        by :meth:`give_back`, when the controller sees this step end, or ``admission_ttl_s``
        after its last admission. A waiting ask is granted whole or not at all, so workers that
        wait never hold parts of the bound that none of them can use; without ``wait``, what the
        bound allows now (perhaps fewer) is granted.

        While the controller is down (it restarts), this waits too; a drain ends the wait (and a
        drained worker is granted 0 at once). A token refused (401, 403) for ``TOKEN_REFUSED_WAIT_S``
        (a restart's scale, :mod:`slurm_elastic.client.refusals`) raises
        :class:`~slurm_elastic.errors.TokenRefusedError`. ``sequences`` is a whole number of at least 1
        (ValueError otherwise). A waiting ask over ``queue.max_concurrent`` raises
        :class:`~slurm_elastic.errors.ApiError` (422: never granted); one over what a steady run
        lets run at once (``(queue.max_staleness + 1) * queue.batch_size``, the admission answer's
        ``most_at_once``) is logged as a warning naming that bound, once: it waits until the
        trainer's versions run ahead of its batches, if ever."""
        sequences = _count("admit", sequences)
        self._usable("admit")
        granted = 0
        while granted < sequences and not self.draining:
            wanted, admission_id = sequences - granted, os.urandom(16).hex()  # one id per ask, kept by its retries
            answer = self._through_outages(
                lambda: self.control.client.admit(wanted, self.ctx.worker_id, admission_id,  # noqa: B023
                                                  whole=wait))
            granted += int(answer["granted"]) if answer else 0
            if granted >= sequences or not wait:
                break
            most = answer.get("most_at_once") if answer else None
            if isinstance(most, int) and wanted > most and not self._over_bound_told:
                self._over_bound_told = True  # a config mismatch: said once, and the ask goes on waiting
                log.warning("RolloutWorker.admit(%d) waits for %d sequences at once, more than a steady run lets "
                            "run at once (%d: queue.max_concurrent and (queue.max_staleness + 1) x "
                            "queue.batch_size): granted only if the trainer's versions run ahead of its batches; "
                            "ask for at most %d at a time", sequences, wanted, most, most)
            time.sleep(poll_s)
        return granted

    def give_back(self, sequences: int) -> int:
        """Give back ``sequences`` admitted that this worker will not submit (a rollout that
        failed, or a group smaller than its admission), so the bound's room goes to another
        worker now instead of after ``admission_ttl_s``. At most what this worker's lease holds
        is released; returns how many were. Waits through a controller restart (a token refused
        that long: :class:`~slurm_elastic.errors.TokenRefusedError`, as :meth:`admit`). ``sequences``: a
        whole number of at least 1 (ValueError otherwise)."""
        sequences = _count("give_back", sequences)
        self._usable("give_back")
        release_id = os.urandom(16).hex()  # kept by the retries: released once
        answer = self._through_outages(
            lambda: self.control.client.release_admission(sequences, self.ctx.worker_id, release_id),
            give_up_on_drain=False)
        return int(answer["released"]) if answer else 0

    def submit(self, group: dict[str, Any]) -> dict[str, Any]:
        """Hand a scored group to the controller's queue, durably. Waits while the buffer is full (429),
        while the controller answers a server error (5xx: its store failed) and while it restarts;
        the group id makes a resend safe. Never drops a group the controller could store; a group
        the controller refuses as invalid (4xx) raises :class:`~slurm_elastic.errors.ApiError`.
        A 401 or 403 (the job's token refused: another job's controller on the old port while this
        job's controller restarts, or a wrong token) is no refusal of the group: the controller's
        address is read again and the group sent there, for as long as it takes, the refusal
        logged as a warning naming the token's source once a minute (the group is never given up).
        A group no trainer step can use is not stored and answered with ``accepted`` false and
        a ``reason`` (logged, not raised: the loop goes on): ``"stale"`` (older than the staleness
        bound allows at the trainer's version) or ``"policy_version_ahead"`` (past the trainer's
        version: a trainer that resumed from an earlier checkpoint, or a wrong version).
        Token ids and masks travel in the compact form (``tokens_b64``, ``mask_b64``); the trainer
        helper turns them back into lists. A token id or mask value that form cannot hold raises
        ValueError naming it (``sequences[2].tokens: [5] is -1``) before anything is sent; numpy
        and torch values (a ``score`` of ``np.float32``, ``tokens`` as an array) go as plain ones.
        The SDK adds ``worker_id``; a group naming another worker raises ValueError."""
        self._usable("submit")
        if group.get("worker_id", self.ctx.worker_id) != self.ctx.worker_id:  # it would use another's lease
            raise ValueError(f"rollout group {group.get('id')!r}: worker_id {group['worker_id']!r} is not this "
                             f"worker's ({self.ctx.worker_id!r}); leave it out, the SDK adds it")
        body = group_json(pack_group({**group, "worker_id": self.ctx.worker_id}))
        maybe_stored = False  # a try that failed may have stored the group: its resend reads "accepted" false

        def attempt() -> dict[str, Any]:
            nonlocal maybe_stored
            try:  # each try short: a controller back on a new port is found
                return self.control.client.submit_group(body, max_wait_s=SUBMIT_TRY_S)
            except ControllerUnreachableError:
                maybe_stored = True
                raise

        while True:
            try:
                answer = self._through_outages(attempt, give_up_on_drain=False, give_up_on_refusal=False)
            except ApiError as exc:  # 429 or 5xx for longer than the client waits: go on waiting
                maybe_stored = maybe_stored or exc.status_code >= 500
                if exc.status_code == 409:  # policy_version past the trainer's: not stored
                    log.warning("rollout group %s not stored: %s", group.get("id"), exc.detail)
                    return {"accepted": False, "reason": "policy_version_ahead", "detail": exc.detail}
                if exc.status_code == 413:  # the route's size cap: name the group and the key
                    raise ApiError(413, f"{exc.detail}: rollout group {group.get('id')!r} is {len(body)} bytes as "
                                        "sent, over queue.max_group_bytes (split it, or raise that key)") from None
                if exc.status_code != 429 and exc.status_code < 500:
                    raise  # refused (4xx): resending the same group cannot help
                continue
            if answer is not None:
                answer = stored_by_an_earlier_try(answer) if maybe_stored else answer
                if answer.get("reason") == "stale":
                    log.info("rollout group %s not stored: %s", group.get("id"), answer.get("detail"))
                elif answer.get("accepted") is False and "reason" not in answer:
                    log.warning("rollout group %s not stored: a group of this id was stored before, not by this call "
                                "(an id must be unique per group: every task of a step, and a step relaunched after a "
                                "crash, runs under worker id %s; use uuid.uuid4().hex, or put the process id in it)", group.get("id"),
                                self.ctx.worker_id)
                return answer

    def _through_outages(self, call: Any, give_up_on_drain: bool = True,
                         give_up_on_refusal: bool = True) -> dict[str, Any] | None:
        """``call()``, retried while the controller is unreachable (re-reading its URL; logged at
        the first failure and every minute after), for up to UNKNOWN_WAIT_S while it does not
        know this worker (404), and while the address refuses the token (401, 403: re-reading the
        URL each time; logged with the token's source every minute): with ``give_up_on_refusal``,
        :class:`~slurm_elastic.errors.TokenRefusedError` once the refusals in a row have gone on
        as long as :class:`~slurm_elastic.client.refusals.TokenRefusals` allows (a restart's
        scale). ``give_up_on_drain``: None once a drain came, instead of waiting on."""
        delay_s = 0.2
        logged_s = refused_logged_s = -math.inf
        unknown_since_s: float | None = None
        refusals = TokenRefusals(self.ctx.token_source)
        while True:
            try:
                result: dict[str, Any] = call()
                return result
            except UnknownOnControllerError as exc:  # a controller restarted without its saved state knows no
                now_s = time.monotonic()             # worker until it lists the job's steps (its first tick)
                refusals.reset()
                if unknown_since_s is None:
                    unknown_since_s = now_s
                    log.warning("%s; asking again for up to %g s", exc, UNKNOWN_WAIT_S)
                if give_up_on_drain and self.draining:
                    return None
                if now_s - unknown_since_s >= UNKNOWN_WAIT_S:
                    raise
                time.sleep(delay_s)
                delay_s = min(5.0, delay_s * 2)
            except ControllerUnreachableError as exc:
                refusals.reset()
                if give_up_on_drain and self.draining:
                    return None
                if time.monotonic() - logged_s >= UNREACHABLE_LOG_S:
                    logged_s = time.monotonic()
                    where = self.ctx.state_dir / "controller.json" if self.ctx.state_dir else "SLURM_ELASTIC_CONTROLLER_URL"
                    log.warning("%s; waiting for it (its address is read again from %s)", exc, where)
                self.control.refresh()
                time.sleep(delay_s)
                delay_s = min(5.0, delay_s * 2)
            except ApiError as exc:  # after the 404's clause: UnknownOnControllerError is one
                if not is_token_refusal(exc):
                    raise
                if give_up_on_drain and self.draining:
                    return None
                url = self.control.client.url
                refusals.refused(exc, url, give_up=give_up_on_refusal)  # raises once they went on long enough
                if time.monotonic() - refused_logged_s >= REFUSED_LOG_S:
                    refused_logged_s = time.monotonic()
                    log.warning("%s", refusals.warning(exc, url))
                if not self.control.refresh(force=True):
                    time.sleep(1.0)

    def close(self) -> None:
        """Stop the heartbeats after a last one (waited for 5 s at most), and the client; the
        worker's calls raise RuntimeError from then."""
        self._closed = True
        self.beats.stop()
        self.control.close()

    def __enter__(self) -> RolloutWorker:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _count(method: str, sequences: object) -> int:
    """A count of sequences the SDK sends, as an int (a numpy integer too): a whole number of at
    least 1 (the route's bound), else ValueError naming the call."""
    try:
        count = operator.index(sequences)  # type: ignore[arg-type]
    except TypeError:
        count = 0
    if isinstance(sequences, bool) or count < 1:
        raise ValueError(f"RolloutWorker.{method}: sequences must be a whole number of at least 1, "
                         f"not {sequences!r}")
    return count
