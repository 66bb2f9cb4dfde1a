"""elastic.toml validation: defaults, units, errors that name the key; the docs cannot drift."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.controller.config import (
    REFERENCE_HEADER,
    config_reference_markdown,
    load_config,
    parse_config,
)
from slurm_elastic.errors import ConfigError

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_defaults_are_sane() -> None:
    config = parse_config({})
    assert config.workers.drain_signal == "USR1" and config.workers.gpus_per_worker == 1
    assert config.workers.drain_timeout_s > config.workers.heartbeat_interval_s > 0


def test_command_string_is_split_like_a_shell() -> None:
    config = parse_config({"workers": {"command": "python -m my.worker --name 'a b' {worker_id}"}})
    assert config.workers.command == ["python", "-m", "my.worker", "--name", "a b", "{worker_id}"]


def test_a_misspelt_placeholder_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"workers.command: unknown placeholder \{gpu\}; the known ones are "
                                          r"\{worker_id\}, \{gpus\}"):
        parse_config({"workers": {"command": "python w.py --gpu {gpu} --id {worker_id}"}})
    shell = parse_config({"workers": {"command": ["bash", "-c", "echo ${HOME} {port}", "{\"json\": 1}"]}})
    assert shell.workers.command[2] == "echo ${HOME} {port}"  # a shell's ${NAME} and other braces pass


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"workers": {"gpus_per_workr": 1}}, "workers.gpus_per_workr: unknown key"),
        ({"wrokers": {}}, "wrokers: unknown key"),
        ({"workers": {"gpus_per_worker": "two"}}, "workers.gpus_per_worker: Input should be a valid integer"),
        ({"workers": {"drain_signal": "KILL"}}, "workers.drain_signal: Input should be 'USR1', 'USR2'"),
        ({"workers": {"drain_timeout_s": -1}}, "workers.drain_timeout_s: Input should be greater than 0"),
        ({"controller": {"tick_interval_s": 0}}, "controller.tick_interval_s: Input should be greater than 0"),
        ({"agent": {"source": "magic"}}, "agent.source"),
        ({"workers": {"requests_per_worker_capacity": 4}},
         "workers.requests_per_worker_capacity: not a [workers] key; set autoscaler.requests_per_worker_capacity"),
    ],
)
def test_errors_name_the_key(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(data)


def test_file_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[workers\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_config_reference_is_generated_from_the_schema() -> None:
    assert (DOCS / "config-reference.md").read_text() == REFERENCE_HEADER + config_reference_markdown()


@pytest.mark.parametrize(("data", "message"), [
    ({"autoscaler": {"max_workers": "lots"}}, "autoscaler.max_workers: must be an integer"),
    ({"queue": {"batch_size": -3}}, "queue.batch_size: must be a positive integer"),
    ({"queue": {"max_staleness": -1}}, "queue.max_staleness: must be a whole number, 0 or more"),
    ({"queue": {"direct_io": "yes"}}, "queue.direct_io: true or false"),
    ({"health": {"nope": 1}}, "health.nope: unknown key"),
])
def test_policy_tables_are_checked_at_load_not_later(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(data)
