"""The worker SDK's heartbeats: its counts every heartbeat interval, the first beat at start that
claims the worker's counts for this process, and the controller's refusal of this process.

Each beat names this process (``instance``, random) and its Slurm step (``step``, job.step). The
controller refuses (409) a process of another step than the worker's (an earlier launch, never
let in) and a second live process of the worker's step (with ``Retry-After`` and
``Holder-Beats``, the holder's beats so far). Standard library only at import: the step wrapper
imports this package.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from slurm_elastic.client.refusals import TokenRefusals, is_token_refusal
from slurm_elastic.errors import ApiError, DuplicateWorkerError, SlurmElasticError

if TYPE_CHECKING:
    from slurm_elastic.worker.context import StepContext
    from slurm_elastic.worker.control import FollowingControl

MAX_CLAIM_WAIT_S = 600.0  # the longest a second process under a worker id waits at start for the holder to go

log = logging.getLogger(__name__)


class Heartbeats:
    """One SDK process's heartbeats for its worker: ``counts()`` sent every heartbeat interval on a
    thread, a drain in the reply sets ``drain``; ``refused``: the controller's refusal of this
    process, once heard (the heartbeats stop then)."""

    def __init__(self, ctx: StepContext, control: FollowingControl[Any], counts: Callable[[], dict[str, Any]],
                 drain: threading.Event) -> None:
        self.ctx, self.control, self._counts, self._drain = ctx, control, counts, drain
        self.instance: str | None = os.urandom(16).hex()  # this process: the controller refuses a second live one
        self.step: str | None = f"{ctx.job_id}.{ctx.step_id}" if ctx.job_id and ctx.step_id else None
        self.refused: DuplicateWorkerError | None = None
        self._token_refusal_told = False  # a token refusal was logged as a warning since the last beat let in
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._forever, name="heartbeat", daemon=True)

    def claim(self) -> bool:
        """A first heartbeat, now: :class:`~slurm_elastic.errors.DuplicateWorkerError` at once for a
        process of another step than the worker's. While another process of this step holds the
        counts, it asks again every heartbeat interval + 0.5 s (sooner if its ``Retry-After`` ends
        first) and raises as soon as the holder's beat count moved between two asks (it lives), or
        after MAX_CLAIM_WAIT_S of asking; the controller lets it in once the holder closed or was
        silent for ``workers.heartbeat_grace_s``. False: a drain came while it waited. A task above
        rank 0 sends no counts, so it claims nothing."""
        waited_s = 0.0
        holder_beats: int | None = None  # at the last ask
        while self.ctx.rank == 0:
            try:
                self.beat(claim=True)
                return True
            except DuplicateWorkerError as exc:
                lives = waited_s > 0 and exc.holder_beats != holder_beats
                if lives or exc.retry_after_s <= 0 or waited_s >= MAX_CLAIM_WAIT_S:
                    raise
                wait_s = min(self.ctx.heartbeat_interval_s + 0.5, exc.retry_after_s, MAX_CLAIM_WAIT_S - waited_s)
                log.log(logging.WARNING if waited_s == 0 else logging.DEBUG, "%s; asking again every %.1f s while the "
                        "other process's beats do not move", exc.detail, self.ctx.heartbeat_interval_s + 0.5)
                holder_beats, waited_s = exc.holder_beats, waited_s + wait_s
                if self._drain.wait(wait_s):
                    log.warning("a drain came before this process was let in: it reports nothing")
                    return False
        return True

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop the heartbeats after a last one (closing: this process lets go of the counts),
        waited for 5 s at most."""
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)

    def _forever(self) -> None:
        """A heartbeat every interval, and a last one at :meth:`stop` with the final counts (the
        rollouts handed over since the last beat, a drained worker's last ones among them)."""
        while not self._stop.wait(self.ctx.heartbeat_interval_s):
            self.beat()
        if self.refused is None:
            self.beat(closing=True)

    def beat(self, claim: bool = False, closing: bool = False) -> None:
        """One heartbeat; ``claim``: raise a refusal of this process (else it stops the heartbeats,
        and the worker's calls raise it, a waiting one included)."""
        counts = self._counts()
        if self.instance is not None:
            counts |= {"instance": self.instance, **({"step": self.step} if self.step else {}),
                       **({"closing": True} if closing else {})}
        try:  # a task above rank 0 of the step: rank 0's counts speak for the step; this one hears drains
            reply = self.control.heartbeat(counts if self.ctx.rank == 0 else {})
        except DuplicateWorkerError as exc:
            if claim:
                raise
            self.refused = exc
            self._stop.set()
            log.error("heartbeats stopped: %s", exc.detail)
            return
        except ApiError as exc:
            if exc.status_code == 422 and self.instance is not None and (
                    "step" in exc.detail or "instance" in exc.detail):  # a controller older than the field
                if "step" in exc.detail and self.step is not None:
                    self.step = None
                else:
                    self.instance = None  # its counts as before
                return self.beat(claim, closing)
            if is_token_refusal(exc) and not self._token_refusal_told:  # not raised: a restart may be on
                self._token_refusal_told = True
                log.warning("heartbeat: %s", TokenRefusals(self.ctx.token_source).warning(
                    exc, self.control.client.url))
                return
            log.debug("heartbeat failed: %s", exc)
            return
        except (KeyError, SlurmElasticError) as exc:
            log.debug("heartbeat failed: %s", exc)
            return
        self._token_refusal_told = False  # the next refusal is told again
        if reply.get("drain"):
            self._drain.set()
