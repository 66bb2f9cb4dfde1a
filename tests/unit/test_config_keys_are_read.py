"""Every key the configuration accepts is read by the code that should act on it.

A static check over the source: for each field of each config schema (the ``elastic.toml`` sections
and the ``[autoscaler]``, ``[queue]`` and ``[health]`` tables), some module other than the ones that
parse ``elastic.toml`` reads it as an attribute (``cfg.<key>``); the ``[job]`` table is read by
the sbatch template or its renderer (``job.<key>``). A key that parses must do something: one nobody reads fails here.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from slurm_elastic.controller.config_sections import (
    AgentSection,
    ControllerSection,
    JobSection,
    WeightsSection,
    WorkersSection,
)
from slurm_elastic.core.autoscaler_config import AutoscalerConfig
from slurm_elastic.core.health import HealthRules
from slurm_elastic.rollouts.queue import QueueConfig

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "slurm_elastic"
CONFIG_MODULES = (PACKAGE / "controller" / "config.py", PACKAGE / "controller" / "config_sections.py")
TEMPLATE = ROOT / "templates" / "elastic_rl.sbatch.j2"
RENDER_MODULE = PACKAGE / "render.py"


def _attributes_read() -> set[str]:
    """Names read as ``x.<name>`` anywhere in the package, except in the modules that parse elastic.toml."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path in CONFIG_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
    return names


def _keys(schema: type) -> list[str]:
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return list(schema.model_fields)
    return [f.name for f in dataclasses.fields(schema)]


READ = _attributes_read()
CODE_SCHEMAS = {"controller": ControllerSection, "workers": WorkersSection, "agent": AgentSection, "weights": WeightsSection,
                "autoscaler": AutoscalerConfig, "queue": QueueConfig, "health": HealthRules}


@pytest.mark.parametrize(("table", "key"), [(t, k) for t, s in CODE_SCHEMAS.items() for k in _keys(s)])
def test_every_key_is_read_by_the_code(table: str, key: str) -> None:
    assert key in READ, f"{table}.{key} is accepted but never read: make it act, or refuse it naming the key that does"


@pytest.mark.parametrize("key", _keys(JobSection))
def test_every_job_key_is_read_by_the_sbatch_template(key: str) -> None:
    text = TEMPLATE.read_text() + RENDER_MODULE.read_text()
    assert re.search(rf"\bjob\.{key}\b", text), f"job.{key} is never rendered"


def test_the_check_finds_an_unread_key() -> None:
    assert "no_such_key_is_read_anywhere" not in READ and "drain_timeout_s" in READ
