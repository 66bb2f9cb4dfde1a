"""What README.md and docs/ promise a user, checked against the code: the key tables of the
tables config-reference.md does not generate (each key there with its default, and every key the
loader takes in the table), every ``slurm-elastic`` command and option the docs show, and every
``elastic.toml`` fragment they show parses, and every route and metric the served API has is in
queue.md's tables. (config-reference.md itself: test_controller_config.py;
the status fields: test_status_doc.py.)"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

import click
import httpx
import pytest

from slurm_elastic.cli import main
from slurm_elastic.controller.config import ElasticConfig, parse_config
from slurm_elastic.core.health import HealthRules
from slurm_elastic.core.scaling import AutoscalerConfig
from slurm_elastic.hooks.common import HookConfig
from slurm_elastic.rollouts.config import QueueConfig
from tests.unit.served_controller import ServedController

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def key_table(doc: str, heading: str) -> dict[str, str]:
    """``{key: default as written}`` from the table under the first heading that contains ``heading``."""
    lines = (ROOT / "docs" / doc).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#") and heading in line)
    end = start + 1
    while not lines[end].startswith("|"):
        end += 1
    table: dict[str, str] = {}
    for line in lines[end:]:
        if not line.startswith("|"):
            break
        if not line.startswith("| `"):
            continue
        names_cell, default_cell = line.split(" | ")[:2]
        names = re.findall(r"`([a-z_]+)`", names_cell)
        defaults = re.findall(r"`([^`]*)`", default_cell) or [v.strip() for v in default_cell.split(",")]
        assert len(names) == len(defaults), line
        table.update(zip(names, defaults, strict=True))
    return table


def same(written: str, default: Any) -> bool:
    if isinstance(default, bool):
        return written == str(default).lower()
    if isinstance(default, int | float):
        return float(written) == default
    if isinstance(default, frozenset):
        return set(json.loads(written)) == set(default)
    try:
        value = json.loads(written)
    except ValueError:
        value = "" if written == "none" else written
    return str(value) == str(default)


@pytest.mark.parametrize(("doc", "heading", "schema"), [
    ("queue.md", "`[queue]`", QueueConfig),
    ("gpu-health.md", "`[health]`", HealthRules),
    ("autoscaler.md", "`[autoscaler]`", AutoscalerConfig),
    ("admin.md", "hooks.toml", HookConfig),
])
def test_every_key_table_names_every_key_with_its_default(doc: str, heading: str, schema: type) -> None:
    table = key_table(doc, heading)
    defaults = {f.name: f.default for f in dataclasses.fields(schema)}
    assert set(table) == set(defaults), f"{doc}: missing {set(defaults) - set(table)}, unknown {set(table) - set(defaults)}"
    wrong = {k: (table[k], defaults[k]) for k in table if not same(table[k], defaults[k])}
    assert wrong == {}, f"{doc}: (written, default) {wrong}"


NOT_COMMANDS = ("slurm-elastic burst parent=",)  # a burst job's Slurm comment


def _code(text: str) -> list[str]:
    """Code the docs show: fenced blocks line by line (``\\``-continued lines joined), then inline spans."""
    pieces: list[str] = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        pieces += block.replace("\\\n", " ").splitlines()
    pieces += re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return pieces


def test_every_command_and_option_the_docs_show_exists() -> None:
    shown = 0
    for doc in DOCS:
        for piece in _code(doc.read_text()):
            for call in re.split(r"(?=\bslurm-elastic\s)", piece)[1:]:
                call = re.split(r"\s(?:\||;|&&|#)\s|\)", call)[0]
                if call.startswith(NOT_COMMANDS):
                    continue
                words = call.split()[1:]
                command: click.Command = main
                while isinstance(command, click.Group) and words and re.fullmatch(r"[a-z][a-z-]*", words[0]):
                    name = words.pop(0)
                    sub = command.get_command(click.Context(command), name)
                    assert sub is not None, f"{doc.name}: `{call.strip()}`: no command {name!r}"
                    command = sub
                known = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)} | {"--help"}
                for option in re.findall(r"(?<![\w-])--[a-z][a-z-]*", call):
                    assert option in known, f"{doc.name}: `{call.strip()}`: {command.name} has no {option}"
                shown += 1
    assert shown > 40  # the docs show the commands; the parse found them


def test_every_elastic_toml_fragment_the_docs_show_parses() -> None:
    fragments = 0
    for doc in DOCS:
        for block in re.findall(r"```toml\n(.*?)```", doc.read_text(), re.S):
            data = tomllib.loads(block)
            if set(data) <= set(ElasticConfig.model_fields):  # not a drill file
                parse_config(data, doc.name)
                fragments += 1
    assert fragments >= 4


def test_queue_md_lists_every_route_and_metric_the_served_api_has(tmp_path: Path) -> None:
    """The routes table and the /metrics table of docs/queue.md against a real served controller."""
    text = (ROOT / "docs" / "queue.md").read_text()
    routes_table = text.split("| route | who | does |")[1].split("\n\n")[0]
    documented_paths: set[str] = set()
    for cell in (line.split(" | ")[0] for line in routes_table.splitlines() if line.startswith("| `")):
        documented_paths.update(re.sub(r"\{[a-z_]+\}", "{}", p) for p in re.findall(r"(/[a-z/{}_.-]*)", cell))
    metrics_table = text.split("| metric | what |")[1].split("\n\n")[0]
    documented_metrics = set(re.findall(r"`(slurm_elastic_[a-z_]+)", metrics_table))
    served = ServedController(tmp_path, "t")
    try:
        auth = {"Authorization": "Bearer t"}
        paths = {re.sub(r"\{[a-z_]+\}", "{}", p) for p in httpx.get(served.url + "/openapi.json", headers=auth).json()["paths"]}
        metrics = set(re.findall(r"^# TYPE (\S+)", httpx.get(served.url + "/metrics", headers=auth).text, re.M))
    finally:
        served.close()
    paths.add("/openapi.json")
    assert documented_paths == paths, documented_paths ^ paths
    assert documented_metrics == metrics, documented_metrics ^ metrics
