"""What an operator's command says when the controller does not answer: `slurm-elastic stop` after
an earlier stop (the batch script's own, at the end of training) finds ``controller.json`` marked by
the controller that obeyed the first, says so and exits 0 instead of failing on the refused
connection (which, under ``set -e``, failed the job); a command that timed out says the controller
may still carry it out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
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


def test_a_command_that_timed_out_says_the_controller_may_still_carry_it_out() -> None:
    """A controller that was stopped (SIGSTOP, a hung disk) carries out what it read once it runs
    again: a timed-out scale says so, and a refused connection (nothing sent) does not."""
    from slurm_elastic.client.control import ControlClient

    def timed_out(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    with ControlClient("http://c", "t", transport=httpx.MockTransport(timed_out)) as client, \
            pytest.raises(ControllerUnreachableError, match="may still carry it out"):
        client.scale(3)
    with ControlClient("http://c", "t", transport=httpx.MockTransport(refused)) as client, \
            pytest.raises(ControllerUnreachableError) as refusal:
        client.scale(3)
    assert "may still" not in str(refusal.value)
