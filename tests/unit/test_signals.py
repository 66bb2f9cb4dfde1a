"""The drain signal's one normalisation and conversion."""

from __future__ import annotations

import signal

import pytest

from slurm_elastic.controller.config import parse_config
from slurm_elastic.core.signals import DEFAULT_DRAIN_SIGNAL, drain_signal_name, drain_signal_number
from slurm_elastic.errors import ConfigError


@pytest.mark.parametrize("raw", ["USR2", "usr2", "SIGUSR2", " sigusr2 "])
def test_every_spelling_is_one_name_and_one_number(raw: str) -> None:
    assert drain_signal_name(raw) == "USR2"
    assert drain_signal_number(raw) is signal.SIGUSR2


def test_a_signal_that_is_not_a_drain_signal_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="'KILL' is not one of USR1, USR2, TERM, INT"):
        drain_signal_name("KILL")


def test_the_config_default_is_the_one_default() -> None:
    assert parse_config({}).workers.drain_signal == DEFAULT_DRAIN_SIGNAL
