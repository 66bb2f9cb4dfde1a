"""A controller's refusal of the client's token (401, 403), as the worker SDK and the trainer
helper take it: tried again, with the controller's address read again before each try (another
job's controller may hold a restarted controller's old port until ``controller.json`` names the
new one), and given up once the refusals have gone on for :data:`TOKEN_REFUSED_TRIES` tries and
:data:`TOKEN_REFUSED_WAIT_S`: :class:`~slurm_elastic.errors.TokenRefusedError`, naming where the
token came from. A restarted controller keeps the job's token, so a refusal that lasts is no
restart: the token is another job's (or was made anew since the client read it), or the address
is not this job's controller. Standard library only: the worker SDK imports it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeGuard

from slurm_elastic.errors import ApiError, TokenRefusedError

TOKEN_REFUSED_TRIES = 3  # refusals in a row before giving up ...
TOKEN_REFUSED_WAIT_S = 10.0  # ... and for at least this long since the first


def is_token_refusal(exc: BaseException) -> TypeGuard[ApiError]:
    """``exc`` is the controller's address refusing the token (401 without one, 403 a wrong one)."""
    return isinstance(exc, ApiError) and not isinstance(exc, TokenRefusedError) and exc.status_code in (401, 403)


class TokenRefusals:
    """The refusals of one call's tries; ``token_source`` says where the client's token came from
    (``SLURM_ELASTIC_TOKEN``, a token file's path) for the error."""

    def __init__(self, token_source: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.token_source = token_source or "the token this client was given"
        self.clock = clock
        self.tries = 0
        self.first_s = 0.0

    def refused(self, exc: ApiError, url: str) -> None:
        """Count one refusal of ``url``; TokenRefusedError once they have gone on long enough."""
        now_s = self.clock()
        if self.tries == 0:
            self.first_s = now_s
        self.tries += 1
        waited_s = now_s - self.first_s
        if self.tries < TOKEN_REFUSED_TRIES or waited_s < TOKEN_REFUSED_WAIT_S:
            return
        raise TokenRefusedError(exc.status_code, (
            f"the controller at {url} refused this process's token on {self.tries} tries over {waited_s:.0f} s "
            f"({exc.detail}); the token is from {self.token_source}: it is not this job's token (another job's, "
            "or the job's token file was written anew since it was read: restart this process), or that address "
            "is not this job's controller"))
