"""A controller's refusal of the client's token (401, 403), as the worker SDK and the trainer
helper take it: tried again, with the controller's address read again before each try. A refusal
need not be a wrong token: while this job's controller restarts (its batch script starts it
again, it asks Slurm, it recovers its store), another job's controller may hold its old port and
refuse every call until ``controller.json`` names the new one, for as long as the restart takes.
So a call that holds data (a worker's submit) never gives up on a refusal; a call that holds none
gives up once the refusals in a row have gone on for :data:`TOKEN_REFUSED_TRIES` tries and
:data:`TOKEN_REFUSED_WAIT_S` (a restart's scale: as long as the trainer waits for an unreachable
controller): :class:`~slurm_elastic.errors.TokenRefusedError`, naming where the token came from.
Standard library only: the worker SDK and the step wrapper import it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeGuard

from slurm_elastic.errors import ApiError, TokenRefusedError

RESTART_WAIT_S = 300.0  # how long a controller restart may take: the clients wait this long through one
TOKEN_REFUSED_TRIES = 3  # refusals in a row before a call that holds no data gives up ...
TOKEN_REFUSED_WAIT_S = RESTART_WAIT_S  # ... and for at least this long since the first of them
REFUSED_LOG_S = 60.0  # a refusal that goes on is logged this often


def is_token_refusal(exc: BaseException) -> TypeGuard[ApiError]:
    """``exc`` is the controller's address refusing the token (401 without one, 403 a wrong one)."""
    return isinstance(exc, ApiError) and not isinstance(exc, TokenRefusedError) and exc.status_code in (401, 403)


class TokenRefusals:
    """The refusals in a row of one call's tries; ``token_source`` says where the client's token
    came from (``SLURM_ELASTIC_TOKEN``, a token file's path) for the warning and the error.
    ``wait_s``: the window (None: :data:`TOKEN_REFUSED_WAIT_S` as it is when a refusal comes)."""

    def __init__(self, token_source: str, clock: Callable[[], float] = time.monotonic,
                 wait_s: float | None = None) -> None:
        self.token_source = token_source or "the token this client was given"
        self.clock = clock
        self.wait_s = wait_s
        self.tries = 0
        self.first_s = self.last_s = 0.0

    def reset(self) -> None:
        """A try ended otherwise (no connection, another error): the next refusal starts a new run."""
        self.tries = 0

    @property
    def window_s(self) -> float:
        return TOKEN_REFUSED_WAIT_S if self.wait_s is None else self.wait_s

    def count(self) -> bool:
        """Count one refusal; True once the refusals in a row have gone on for
        TOKEN_REFUSED_TRIES tries and the window: time to give up."""
        self.last_s = self.clock()
        if self.tries == 0:
            self.first_s = self.last_s
        self.tries += 1
        return self.spent()

    def spent(self) -> bool:
        """The refusals in a row so far went on for TOKEN_REFUSED_TRIES tries and the window."""
        return self.tries >= TOKEN_REFUSED_TRIES and self.last_s - self.first_s >= self.window_s

    def refused(self, exc: ApiError, url: str, give_up: bool = True) -> None:
        """Count one refusal of ``url``; with ``give_up``, TokenRefusedError once it is time to."""
        if self.count() and give_up:
            raise self.error(exc, url)

    def error(self, exc: ApiError, url: str) -> TokenRefusedError:
        """The refusals so far as the error a call raises when it gives up."""
        return TokenRefusedError(exc.status_code, (
            f"the controller at {url} refused this process's token on {self.tries} tries in a row over "
            f"{self.clock() - self.first_s:.0f} s ({exc.detail}); the token is from {self.token_source}: not "
            "this job's token (another job's, or the job's token file was written anew since it was read: restart "
            "this process), that address is not this job's controller, or a controller restart in progress "
            "(another job's controller on its old address until controller.json names the new one)"))

    def warning(self, exc: ApiError, url: str) -> str:
        """A line for the log while the refusals go on."""
        return (f"the controller at {url} refused this process's token ({exc.detail}; the token is from "
                f"{self.token_source}): a wrong token, or another job's controller on the old address while this "
                "job's controller restarts; asking again, the address read again from controller.json")
