"""The worker SDK's heartbeats: its counts every heartbeat interval, and a last one at close.

Each beat names this process (``instance``, random) and its Slurm step (``step``, job.step). The
controller never refuses a beat for them: when the beat's counts are not the worker's (a process
of an earlier step, or a second live process of the worker's step), it answers as usual without
applying them (``counts_applied`` false, ``counts_note`` saying why), logged here once as a
warning (again after counts were applied in between). Standard library only at import: the step
wrapper imports this package.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from slurm_elastic.client.answers import paced_interval_s
from slurm_elastic.client.refusals import TokenRefusals, is_token_refusal
from slurm_elastic.errors import ApiError, SlurmElasticError

if TYPE_CHECKING:
    from slurm_elastic.worker.context import StepContext
    from slurm_elastic.worker.control import FollowingControl

log = logging.getLogger(__name__)


class Heartbeats:
    """One SDK process's heartbeats for its worker: ``counts()`` sent every heartbeat interval (the
    one the controller's last answer asked for) on a thread; a drain in the reply sets ``drain``."""

    def __init__(self, ctx: StepContext, control: FollowingControl[Any], counts: Callable[[], dict[str, Any]],
                 drain: threading.Event) -> None:
        self.ctx, self.control, self._counts, self._drain = ctx, control, counts, drain
        self.instance: str | None = os.urandom(16).hex()  # this process: the controller tells its counts apart
        self.step: str | None = f"{ctx.job_id}.{ctx.step_id}" if ctx.job_id and ctx.step_id else None
        self._token_refusal_told = False  # a token refusal was logged as a warning since the last beat let in
        self._counts_note_told = False  # counts not applied was logged since counts were last applied
        self.interval_s = ctx.heartbeat_interval_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._forever, name="heartbeat", daemon=True)

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
        while not self._stop.wait(self.interval_s):
            self.beat()
        self.beat(closing=True)

    def beat(self, closing: bool = False) -> None:
        """One heartbeat; never raises (a failed one is logged, the next one tries again)."""
        counts = self._counts()
        if self.instance is not None:
            counts |= {"instance": self.instance, **({"step": self.step} if self.step else {}),
                       **({"closing": True} if closing else {})}
        try:  # a task above rank 0 of the step: rank 0's counts speak for the step; this one hears drains
            reply = self.control.heartbeat(counts if self.ctx.rank == 0 else {})
        except ApiError as exc:
            if exc.status_code == 422 and self.instance is not None and (
                    "step" in exc.detail or "instance" in exc.detail):  # a controller older than the field
                if "step" in exc.detail and self.step is not None:
                    self.step = None
                else:
                    self.instance = None  # its counts as before
                return self.beat(closing)
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
        self.interval_s = paced_interval_s(reply, self.interval_s)
        if reply.get("counts_applied") is False:
            if not self._counts_note_told:
                self._counts_note_told = True
                log.warning("worker %s: the controller did not count this process's rollouts: %s",
                            self.ctx.worker_id, reply.get("counts_note") or "no reason given")
        elif self.ctx.rank == 0:
            self._counts_note_told = False
        if reply.get("drain"):
            self._drain.set()
