"""The error tree of slurm-elastic.

Foreign errors (subprocess, httpx, NVML, sqlite) are converted into these at the adapter
boundary, so callers catch one small documented family.
"""

from __future__ import annotations

from collections.abc import Iterable

EXIT_CONFIG = 78  # sysexits' EX_CONFIG: a configuration error; the batch script does not restart the controller


class SlurmElasticError(Exception):
    """Base of every error slurm-elastic raises on purpose."""


class ConfigError(SlurmElasticError):
    """A configuration file or value is invalid; the message names the key."""


def unknown_key(key: str, known: Iterable[str]) -> str:
    """"unknown key", with the closest known key where one is close (a typo)."""
    import difflib  # here, not at the top: a worker step's wrapper imports this module at every start

    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.75)
    return f"unknown key (did you mean {close[0]}?)" if close else "unknown key"


class StateFileError(SlurmElasticError):
    """A state file is corrupt, foreign or unreadable; the message names the file."""


class TransitionError(SlurmElasticError):
    """A worker state change that the lifecycle table does not allow."""


class SlurmError(SlurmElasticError):
    """Slurm is missing, unreachable, or refused a request."""


class SlurmCommandError(SlurmError):
    """A Slurm command exited non-zero (or could not be run)."""

    def __init__(
        self, argv: list[str], returncode: int | None, stdout: str, stderr: str, reason: str = ""
    ) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        detail = reason or (stderr.strip().splitlines()[-1] if stderr.strip() else "no stderr")
        super().__init__(f"{' '.join(self.argv[:3])}... failed (rc={returncode}): {detail}")


class SlurmUnavailableError(SlurmError):
    """Slurm answered with an error instead of data (slurmctld down, hung or unreachable)."""


class SlurmTimeoutError(SlurmCommandError):
    """A Slurm command ran past its timeout and was killed."""


class SlurmNotInstalledError(SlurmError):
    """A Slurm binary is not on PATH."""


class DevClusterError(SlurmElasticError):
    """The local dev cluster could not be brought up, inspected or taken down."""


class ControllerUnreachableError(SlurmElasticError):
    """The controller's HTTP API did not answer; ``not_connected``: no connection was made, so
    nothing of the request was sent (a restarting controller refuses connections)."""

    def __init__(self, message: str, not_connected: bool = False) -> None:
        super().__init__(message)
        self.not_connected = not_connected


class ControllerNotAskedError(ControllerUnreachableError):
    """The controller was not asked: what names it or its token is missing or damaged on this side
    (its controller file, the job's token file)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, not_connected=True)


class ControllerAnswerError(ControllerUnreachableError):
    """What answered at the controller's address is not the controller's API: an answer that is
    not a JSON object, a redirect, one too large, or one whose body did not arrive within the
    call's timeout. The request may have reached a controller, so a retry with the same ids is
    safe, as after no answer (workers and the trainer read the controller's address again)."""


class ApiError(SlurmElasticError):
    """The controller's HTTP API answered with an error status."""

    def __init__(self, status_code: int, detail: str) -> None:
        self.status_code = status_code
        self.detail = detail
        super().__init__(f"HTTP {status_code}: {detail}")


class TokenRefusedError(ApiError):
    """The controller's address refused this process's token (401, 403) on every try for as long
    as a controller restart may take (another job's controller may hold the old address that
    long): the token is not the job's, or the address is another job's controller. A restarted
    controller keeps the job's token (its file, else the copy beside it)."""


class ControllerStoppedError(SlurmElasticError):
    """The job's controller was stopped (``slurm-elastic stop``): no more batches will come."""


class UnknownOnControllerError(ApiError, KeyError):
    """The controller answered 404: it does not know the worker, node, GPU or batch named. An
    :class:`ApiError` with ``status_code`` 404 and a ``KeyError``; its message is the detail."""

    def __init__(self, detail: str) -> None:
        self.status_code, self.detail = 404, detail
        Exception.__init__(self, detail)

    def __str__(self) -> str:
        return self.detail


class TrainerSupersededError(ApiError):
    """The controller refused a trainer call (409): a newer trainer registered on the job since."""


class TelemetryError(SlurmElasticError):
    """A GPU telemetry source could not start or read (NVML missing, bad injection file)."""
