"""Rendered batch scripts: golden files, and the shipped example kept in sync with its config."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.controller.config import load_config, parse_config
from slurm_elastic.errors import ConfigError
from slurm_elastic.render import render_sbatch

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data" / "render"


def test_minimal_config_matches_its_golden_file() -> None:
    text = render_sbatch(load_config(DATA / "minimal.toml"), "tests/unit/data/render/minimal.toml")
    assert text == (DATA / "minimal.sbatch").read_text()
    assert "#SBATCH --cpus-per-task=8" in text and "#SBATCH --time=01:00:00" in text
    assert "python train.py --lr 3e-4" in text and "--drain-timeout-s 45" in text


def test_the_example_is_one_rendered_instance() -> None:
    result = CliRunner().invoke(main, ["render", "--config", "examples/elastic.toml"])
    assert result.exit_code == 0, result.output
    assert result.output == (REPO / "examples" / "elastic_rl.sbatch").read_text(), (
        "examples/elastic_rl.sbatch is out of date: slurm-elastic render --config examples/elastic.toml "
        "> examples/elastic_rl.sbatch")


def test_render_needs_a_trainer() -> None:
    with pytest.raises(ConfigError, match=r"job\.trainer_command is empty"):
        render_sbatch(parse_config({}), "x.toml")


def test_shell_quoting_of_arguments() -> None:
    config = parse_config({"job": {"trainer_command": ["python", "t.py", "--name", "a b; rm -rf /"]}})
    assert "python t.py --name 'a b; rm -rf /'" in render_sbatch(config, "my config.toml")
    assert "CONFIG='my config.toml'" in render_sbatch(config, "my config.toml")
