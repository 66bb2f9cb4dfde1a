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
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.files import mark_stopped_by_operator, publish
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.lifecycle import WorkerState
from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.errors import ControllerUnreachableError
from slurm_elastic.slurm.parse import StepInfo
from tests.stub_backend import ListedSteps


class Gone:
    """The client of a controller that no longer answers."""

    def __enter__(self) -> Gone:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def scale(self, _workers: int) -> Any:
        raise ControllerUnreachableError("controller at http://127.0.0.1:1 did not answer: Connection refused",
                                         not_connected=True)


def run_stop(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    handle = JobHandle(7, state_dir, "http://127.0.0.1:1", "t", {})
    monkeypatch.setattr("slurm_elastic.commands.jobs._client", lambda job_id, *a, **k: (handle, Gone()))
    monkeypatch.setattr("slurm_elastic.commands.jobs._batch_script_ended", lambda job_id: None)  # job 7 runs
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
    monkeypatch.setattr("slurm_elastic.commands.jobs.RESTART_WAIT_S", 0.3)
    code, out = run_stop(tmp_path, monkeypatch)
    assert code != 0 and "did not answer" in out and "restarting?" in out, out


class Restarting:
    """A controller that refuses two connections (the batch script restarts it), then answers."""

    def __init__(self) -> None:
        self.calls = 0

    def __enter__(self) -> Restarting:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def drain(self, worker_id: str) -> Any:
        self.calls += 1
        if self.calls <= 2:
            raise ControllerUnreachableError("controller at http://127.0.0.1:1 did not answer: [Errno 111] "
                                             "Connection refused", not_connected=True)
        return {"worker_id": worker_id, "state": "DRAINING"}


def test_an_operator_command_waits_out_a_controller_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    handle, controller = JobHandle(7, tmp_path, "http://127.0.0.1:1", "t", {}), Restarting()
    monkeypatch.setattr("slurm_elastic.commands.jobs._client", lambda job_id, *a, **k: (handle, controller))
    monkeypatch.setattr("slurm_elastic.commands.jobs._batch_script_ended", lambda job_id: None)  # job 7 runs
    monkeypatch.setattr("slurm_elastic.commands.jobs.RESTART_RETRY_S", 0.01)
    result = CliRunner().invoke(main, ["drain", "7", "3"])
    assert result.exit_code == 0 and "worker 0003 is DRAINING" in result.output and controller.calls == 3, result.output
    assert "refuses connections (restarting?)" in result.output


def test_status_of_a_stopped_controller_says_it_was_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slurm_elastic.client.locate import SlurmView
    from slurm_elastic.commands.jobs import collect_status

    publish(tmp_path, "http://127.0.0.1:1", 7)
    mark_stopped_by_operator(tmp_path)
    handle = JobHandle(7, tmp_path, "http://127.0.0.1:1", "t", {})

    class Down(Gone):
        def status(self) -> Any:
            raise ControllerUnreachableError("controller at http://127.0.0.1:1 did not answer: Connection refused")

    class NoSteps:
        def list_steps(self, _job_id: int) -> list[Any]:
            return []

        def list_jobs_named(self, _name: str, user: str | None = None) -> list[Any]:
            return []

    monkeypatch.setattr("slurm_elastic.commands.jobs.ask_slurm", lambda job_id, slurm: SlurmView(None, ""))
    monkeypatch.setattr("slurm_elastic.commands.jobs._client", lambda job_id, *a, **k: (handle, Down()))
    doc = collect_status(7, NoSteps())  # type: ignore[arg-type]
    assert "stopped by `slurm-elastic stop` at" in doc["controller_error"] and not doc["controller_reachable"]


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
    assert "may still" not in str(refusal.value) and refusal.value.not_connected


def test_status_says_a_wrong_token_and_a_suspended_job_in_its_document(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from slurm_elastic.client.locate import SlurmView
    from slurm_elastic.commands.jobs import _render, call_controller, collect_status
    from slurm_elastic.errors import ApiError, SlurmElasticError
    from slurm_elastic.slurm.parse import JobInfo

    handle = JobHandle(7, tmp_path, "http://127.0.0.1:1", "t", {})

    class WrongToken(Gone):
        def status(self) -> Any:
            raise ApiError(403, "wrong token for this job")

        def scale(self, _workers: int) -> Any:
            raise ApiError(403, "wrong token for this job")

    class NoSteps:
        def list_steps(self, _job_id: int) -> list[Any]:
            return []

        def list_jobs_named(self, _name: str, user: str | None = None) -> list[Any]:
            return []

    running = JobInfo(7, "rl", "RUNNING", ("node1",), "node1", "", "u", "debug")
    monkeypatch.setattr("slurm_elastic.commands.jobs.ask_slurm", lambda job_id, slurm: SlurmView(running, ""))
    monkeypatch.setattr("slurm_elastic.commands.jobs.locate_running", lambda job_id, view: handle)
    monkeypatch.setattr("slurm_elastic.commands.jobs.ControlClient", lambda url, token: WrongToken())
    doc = collect_status(7, NoSteps())  # type: ignore[arg-type]
    assert doc["controller_error"] == f"HTTP 403: wrong token for this job (token read from {tmp_path / 'token'})"
    assert doc["controller_refused"] and "controller: REFUSED the request (HTTP 403: wrong token" in _render(doc)
    suspended = JobInfo(7, "rl", "SUSPENDED", ("node1",), "node1", "", "u", "debug")
    monkeypatch.setattr("slurm_elastic.commands.jobs.ask_slurm", lambda job_id, slurm: SlurmView(suspended, ""))
    doc = collect_status(7, NoSteps())  # type: ignore[arg-type]
    assert doc["controller_error"] == "job 7 is SUSPENDED: its controller answers again after `scontrol resume 7`"
    monkeypatch.setattr("slurm_elastic.commands.jobs._client", lambda job_id, *a, **k: (handle, WrongToken()))
    with pytest.raises(SlurmElasticError, match=r"HTTP 403: wrong token for this job \(token read from "):
        call_controller(7, "scale", 3)  # an operator command says which token too


class CancelsSteps(ListedSteps):
    """Slurm listing the given steps; each step cancel recorded."""

    def __init__(self, steps: list[StepInfo]) -> None:
        super().__init__(steps)
        self.cancelled: list[tuple[int, str]] = []

    def cancel_step(self, job_id: int, step_id: str) -> None:
        self.cancelled.append((job_id, step_id))


def test_a_stop_releases_the_placeholders(tmp_path: Path) -> None:
    """Before, a placeholder's step (holding a cordoned GPU) ran on after `slurm-elastic stop`, and
    the last state.json kept it ACTIVE, holding its GPU until the job ended: no controller
    follows an operator's stop to release it."""
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    backend = CancelsSteps([StepInfo(1, "3", worker_step_name("w1"), ("node1",), "0:01", "", "gres/gpu:1", 1),
                            StepInfo(1, "4", worker_step_name("w2"), ("node1",), "0:01", "", "gres/gpu:1", 1)])
    controller = Controller(config, 1, backend, tmp_path, gpus_by_node={"node1": (0, 1)})  # type: ignore[arg-type]
    controller.scale(2)
    controller.tick()  # both steps listed: this controller's workers
    controller.cordon("node1", 0, "fan noise")
    assert controller.register_worker("w1", {"node": "node1", "gpus": [0], "step_id": "3"})["action"] == "hold"
    controller.register_worker("w2", {"node": "node1", "gpus": [1], "step_id": "4"})
    assert controller.request_stop() == {"stopping": True, "placeholders_released": ["w1"]}
    assert backend.cancelled == [(1, "3")]  # the worker's step is not: it drains, or runs on with the job
    saved = json.loads((tmp_path / "state.json").read_text())["state"]["workers"]
    assert (saved["w1"]["state"], saved["w1"]["step_id"]) == ("INACTIVE", "3")
    assert saved["w1"]["history"][-1][3] == "placeholder released: the controller stopped (slurm-elastic stop)"
    assert saved["w2"]["state"] == "ACTIVE"
    controller.tick()  # the stub lists step 3 still, as a listing taken before the cancel: not adopted
    assert controller.state.workers["w1"].state is WorkerState.INACTIVE


def test_status_with_the_controller_down_lists_its_burst_jobs_and_their_steps(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A live probe: with the controller down (SIGSTOP), status listed the parent job's 4 worker
    steps only, while 4 more ran in 2 burst jobs holding 4 GPUs; another parent's burst job (same
    name, its own comment) is not listed."""
    from slurm_elastic.client.locate import SlurmView
    from slurm_elastic.commands.jobs import _render, collect_status
    from slurm_elastic.slurm.parse import JobInfo, QueuedJob, StepInfo

    handle = JobHandle(7, tmp_path, "http://127.0.0.1:1", "t", {})

    class Down(Gone):
        def status(self) -> Any:
            raise ControllerUnreachableError("controller at http://127.0.0.1:1 did not answer: timed out")

    def step(job_id: int, step_id: str, name: str, node: str) -> StepInfo:
        return StepInfo(job_id, step_id, name, (node,), "1:00", "", "gres/gpu:1", 1)

    class Slurm:
        users: list[str | None] = []

        def list_steps(self, job_id: int) -> list[StepInfo]:
            return [step(job_id, "1", "se-w-0001", "node1")]

        def list_jobs_named(self, name: str, user: str | None = None) -> list[QueuedJob]:
            assert name == "elastic-burst-7"
            self.users.append(user)
            return [QueuedJob(8, "RUNNING", ("node2",), 2, "", "", 1, "p", name, "slurm-elastic burst parent=7"),
                    QueuedJob(9, "PENDING", (), 2, "Resources", "", 1, "p", name,
                              "slurm-elastic burst parent=7 released"),
                    QueuedJob(10, "RUNNING", ("node2",), 2, "", "", 1, "p", name, "someone else's")]

        def list_steps_of(self, job_ids: list[int]) -> list[StepInfo]:
            assert job_ids == [8]
            return [step(8, "1", "se-w-0002", "node2")]

    running = JobInfo(7, "rl", "RUNNING", ("node1",), "node1", "", "alice", "debug")
    monkeypatch.setattr("slurm_elastic.commands.jobs.ask_slurm", lambda job_id, slurm: SlurmView(running, ""))
    monkeypatch.setattr("slurm_elastic.commands.jobs._client", lambda job_id, *a, **k: (handle, Down()))
    slurm = Slurm()
    doc = collect_status(7, slurm)  # type: ignore[arg-type]
    assert [s["step_id"] for s in doc["slurm_steps"]] == ["7.1", "8.1"] and slurm.users == ["alice"]
    assert doc["slurm_burst_jobs"] == [{"job_id": 8, "state": "RUNNING", "nodes": ["node2"], "reason": ""},
                                       {"job_id": 9, "state": "PENDING", "nodes": [], "reason": "Resources"}]
    text = _render(doc)
    assert "8.1   se-w-0002  node2  1:00" in text and "burst jobs Slurm lists for it: 2" in text
    assert "9    PENDING  -      Resources" in text
