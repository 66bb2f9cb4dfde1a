"""`status --watch` refreshes until interrupted (the status source is stubbed: this tests the CLI loop)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.commands import jobs

DOC: dict[str, Any] = {"schema_version": 1, "job_id": 5, "job_state": "RUNNING", "controller_reachable": True,
                       "controller_error": "", "slurm_steps": [],
                       "controller": {"controller_url": "http://h:1", "target_workers": 2, "workers": []}}


def three_refreshes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The status source stubbed, and Ctrl-C after its third call; the job ids it was asked for."""
    calls: list[int] = []
    monkeypatch.setattr(jobs, "collect_status", lambda job_id: calls.append(job_id) or DOC)

    def sleep(_s: float) -> None:
        if len(calls) >= 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(jobs.time, "sleep", sleep)
    return calls


def test_watch_refreshes_until_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = three_refreshes(monkeypatch)
    result = CliRunner().invoke(main, ["status", "5", "--watch", "--interval-s", "0.01"])
    assert result.exit_code == 0 and calls == [5, 5, 5]
    assert result.output.count("job 5\ncontroller: http://h:1") == 3


def test_watch_json_piped_writes_one_document_a_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped (as a script or `| jq -c` reads it), each refresh is one line of JSON."""
    three_refreshes(monkeypatch)
    result = CliRunner().invoke(main, ["status", "5", "--watch", "--json", "--interval-s", "0.01"])
    lines = result.output.splitlines()
    assert result.exit_code == 0 and len(lines) == 3 and [json.loads(line) for line in lines] == [DOC] * 3


def test_unreachable_controller_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    down = {**DOC, "controller_reachable": False, "controller": None, "controller_error": "refused",
            "slurm_steps": [{"step_id": "5.0", "name": "se-w-0001", "nodes": ["n1"], "time_used": "1:00"}]}
    monkeypatch.setattr(jobs, "collect_status", lambda job_id: down)
    result = CliRunner().invoke(main, ["status", "5"])
    assert result.exit_code == 3 and "UNREACHABLE (refused)" in result.output and "se-w-0001" in result.output
