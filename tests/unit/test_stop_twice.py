"""`slurm-elastic stop` after an operator's stop (the batch script's own, at the end of training):
the controller that obeyed the first marked ``controller.json``, so the second says so and exits 0
instead of failing on the refused connection (which, under ``set -e``, failed the job)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.client.locate import JobHandle
from slurm_elastic.controller.files import mark_stopped_by_operator, publish
from slurm_elastic.errors import ControllerUnreachableError


class Gone:
    """The client of a controller that no longer answers."""

    def __enter__(self) -> Gone:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def scale(self, _workers: int) -> Any:
        raise ControllerUnreachableError("controller at http://127.0.0.1:1 did not answer: Connection refused")


def run_stop(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    handle = JobHandle(7, state_dir, "http://127.0.0.1:1", "t", {})
    monkeypatch.setattr("slurm_elastic.commands.jobs._client", lambda job_id, *a, **k: (handle, Gone()))
    result = CliRunner().invoke(main, ["stop", "7", "--drain-timeout-s", "5"])
    return result.exit_code, result.output


def test_a_second_stop_finds_the_controller_stopped_and_exits_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    publish(tmp_path, "http://127.0.0.1:1", 7)
    mark_stopped_by_operator(tmp_path)
    assert "stopped_by_operator_at" in json.loads((tmp_path / "controller.json").read_text())
    code, out = run_stop(tmp_path, monkeypatch)
    assert code == 0 and "its controller was stopped already (slurm-elastic stop" in out, out


def test_a_controller_that_died_otherwise_is_still_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    publish(tmp_path, "http://127.0.0.1:1", 7)  # a new controller's publish: no stop mark
    code, out = run_stop(tmp_path, monkeypatch)
    assert code != 0 and "did not answer" in out, out
