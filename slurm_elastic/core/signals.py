"""The drain signal: its allowed names, its default, and the one normalisation (``sigusr1`` ->
``USR1``) and conversion to a signal number, for the config, the worker's environment and the
worker's handlers alike."""

from __future__ import annotations

import signal
from typing import Literal, cast, get_args

from slurm_elastic.errors import ConfigError

DrainSignal = Literal["USR1", "USR2", "TERM", "INT"]
DRAIN_SIGNALS: tuple[str, ...] = get_args(DrainSignal)
DEFAULT_DRAIN_SIGNAL: DrainSignal = "USR1"


def drain_signal_name(raw: str) -> DrainSignal:
    """``raw`` as the name the config, Slurm and the worker use (upper case, no ``SIG``)."""
    name = raw.strip().upper().removeprefix("SIG")
    if name not in DRAIN_SIGNALS:
        raise ConfigError(f"drain signal {raw!r} is not one of {', '.join(DRAIN_SIGNALS)}")
    return cast(DrainSignal, name)


def drain_signal_number(raw: str) -> signal.Signals:
    """The signal number of a drain signal name (any spelling :func:`drain_signal_name` takes)."""
    return signal.Signals[f"SIG{drain_signal_name(raw)}"]
