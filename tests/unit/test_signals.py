"""Signal names' one normalisation and the drain signal's conversion; settings' one default."""

from __future__ import annotations

import signal

import pytest

from slurm_elastic.controller.config import parse_config
from slurm_elastic.core import defaults
from slurm_elastic.core.reconcile import ReconcileConfig
from slurm_elastic.core.signals import (
    DEFAULT_DRAIN_SIGNAL,
    drain_signal_name,
    drain_signal_number,
    signal_name,
)
from slurm_elastic.core.tick import TickConfig
from slurm_elastic.errors import ConfigError, SlurmError
from slurm_elastic.sim.trace import ClusterSpec
from slurm_elastic.slurm.backend import step_signal_name
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.worker.context import StepContext


@pytest.mark.parametrize("raw", ["USR2", "usr2", "SIGUSR2", " sigusr2 "])
def test_every_spelling_is_one_name_and_one_number(raw: str) -> None:
    assert drain_signal_name(raw) == "USR2"
    assert drain_signal_number(raw) is signal.SIGUSR2


def test_a_signal_that_is_not_a_drain_signal_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="'KILL' is not one of USR1, USR2, TERM, INT"):
        drain_signal_name("KILL")


def test_the_config_default_is_the_one_default() -> None:
    assert parse_config({}).workers.drain_signal == DEFAULT_DRAIN_SIGNAL


@pytest.mark.parametrize(("raw", "name"), [("STOP", "STOP"), ("sigcont", "CONT"), (" usr1 ", "USR1"), ("TERM", "TERM")])
def test_any_signal_sent_to_a_step_has_the_one_spelling(raw: str, name: str) -> None:
    assert signal_name(raw) == step_signal_name(raw) == name


@pytest.mark.parametrize("raw", ["BOGUS", "9", "USR1; rm", ""])
def test_a_name_that_is_no_signal_is_refused_before_slurm_is_asked(raw: str) -> None:
    assert signal_name(raw) is None
    with pytest.raises(SlurmError, match="not a signal name"):
        SlurmCli().signal_step(1, "0", raw)


def test_the_defaults_of_settings_read_in_several_places_are_the_core_ones() -> None:
    workers, env = parse_config({}).workers, {"SLURM_ELASTIC_WORKER_ID": "1", "SLURM_ELASTIC_CONTROLLER_URL": "u",
                                               "SLURM_ELASTIC_TOKEN": "t"}
    ctx, rcfg = StepContext.from_env(env), ReconcileConfig()
    assert workers.start_timeout_s == rcfg.start_timeout_s == ctx.start_timeout_s == defaults.START_TIMEOUT_S
    assert workers.heartbeat_interval_s == ctx.heartbeat_interval_s == defaults.HEARTBEAT_INTERVAL_S
    assert workers.heartbeat_grace_s == rcfg.heartbeat_grace_s == ClusterSpec().heartbeat_grace_s
    assert (workers.backoff_base_s, workers.backoff_max_s) == (rcfg.backoff_base_s, rcfg.backoff_max_s)
    assert workers.server_drain_grace_s == TickConfig(rcfg).server_drain_grace_s
