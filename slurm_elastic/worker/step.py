"""The worker step's entry: ``slurm-elastic worker -- CMD ...`` and ``python -m slurm_elastic worker -- CMD ...``.

The controller starts every worker step as ``python -m slurm_elastic worker -- CMD ...``; that
form comes here without the click layer (see ``slurm_elastic.__main__``), so a step's start
imports only the wrapper, its context and the stdlib client of the two calls it makes.
"""

from __future__ import annotations

import logging
import sys

from slurm_elastic.client.refusals import is_token_refusal
from slurm_elastic.client.step_calls import StepControlClient
from slurm_elastic.errors import ApiError, SlurmElasticError, TokenRefusedError
from slurm_elastic.worker.context import StepContext
from slurm_elastic.worker.control import FollowingControl
from slurm_elastic.worker.wrapper import Flags, install_handlers, run_wrapped

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # as the CLI's


def run_step(command: list[str]) -> int:
    """Run ``command`` as a drain-safe worker step (register, heart-beat, forward the drain); its exit code."""
    ctx = StepContext.from_env()
    flags = Flags()
    install_handlers(flags, ctx.drain_signum, term_drains=ctx.term_drains)
    control = FollowingControl(ctx.worker_id, ctx.controller_url, ctx.token, ctx.state_dir, connect=StepControlClient)
    try:
        return run_wrapped(command, ctx, control.register, control.heartbeat, flags=flags)
    except ApiError as exc:
        if is_token_refusal(exc):  # the registration refused on every try: say which token
            raise TokenRefusedError(exc.status_code, f"{exc.detail} at {control.client.url} on every try (a wrong "
                                                     "token, or a controller restart still in progress); the token "
                                                     f"is from {ctx.token_source}") from None
        raise
    finally:
        control.close()


def main(command: list[str]) -> None:
    """Exit with the step's exit code; our own errors as one line and exit code 1, as the CLI does."""
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    try:
        code = run_step(command)
    except SlurmElasticError as exc:
        print(f"slurm-elastic: error: {exc}", file=sys.stderr)
        code = 1
    sys.exit(code)
