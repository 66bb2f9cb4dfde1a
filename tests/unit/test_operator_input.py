"""Operator commands given bad arguments or a damaged state directory: a one-line error and a
nonzero exit, never a traceback, a wait that never ends or a call that changes something; and the
controller stops on the API's word, from whichever host asks (the real server, a real loop)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.client.control import ControlClient
from slurm_elastic.client.files import TOKEN_COPY, read_token_file
from slurm_elastic.commands import jobs, worker_pool
from slurm_elastic.controller.app import create_controller_app
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.files import ensure_token
from slurm_elastic.controller.guard import RequestGuard
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.serve import ApiServer
from slurm_elastic.errors import ApiError, ConfigError, SlurmError, SlurmUnavailableError
from slurm_elastic.slurm.parse import JobInfo, parse_jobs_json
from slurm_elastic.worker.context import StepContext
from tests.recording_listener import recording_listener
from tests.stub_backend import ListedSteps

TOKEN = "operator-token"
JOB = 4242


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


@pytest.mark.parametrize("args", [
    ("status", str(JOB), "--watch", "--interval-s", "-1"),
    ("status", str(JOB), "--watch", "--interval-s", "nan"),
    ("status", str(JOB), "--interval-s", "0"),
    ("scale", str(JOB), "2", "--wait", "--timeout-s", "nan"),
    ("scale", str(JOB), "2", "--wait", "--timeout-s", "-5"),
    ("wait-ready", str(JOB), "--timeout-s", "inf"),
    ("wait-ready", str(JOB), "--timeout-s", "soon"),
    ("stop", str(JOB), "--drain-timeout-s", "nan"),
    ("drain", str(JOB), "../../x"),
    ("drain", str(JOB), "x y"),
    ("drain", str(JOB), ""),
    ("burst-watch", "--state-dir", "/nonexistent", "--interval-s", "nan"),
    ("burst-watch", "--state-dir", "/nonexistent", "--interval-s", "inf"),
    ("burst-watch", "--state-dir", "/nonexistent", "--interval-s", "-1"),
    ("burst-watch", "--state-dir", "/nonexistent", "--interval-s", "0"),
    ("burst-watch", "--state-dir", "/nonexistent", "--grace-s", "nan"),
    ("burst-watch", "--state-dir", "/nonexistent", "--grace-s", "inf"),
    ("burst-watch", "--state-dir", "/nonexistent", "--grace-s", "-300"),
    # past a year: time.sleep and thread waits raised OverflowError (a traceback) at 1e300
    ("status", str(JOB), "--watch", "--interval-s", "1e300"),
    ("burst-watch", "--state-dir", "/nonexistent", "--grace-s", "1e300", "--interval-s", "1e300"),
    ("wait-ready", str(JOB), "--timeout-s", "31622401"),
    ("stop", str(JOB), "--drain-timeout-s", "1e20"),
    ("scale", str(JOB), "2", "--wait", "--timeout-s", "1e300"),
    # counts past what Slurm has: a 32-bit job id, MaxStepCount workers
    ("status", "99999999999999999999999999"),
    ("status", "4294967296"),
    ("scale", str(JOB), "40001"),
    ("burst-watch", "--state-dir", "/nonexistent", "--parent-job-id", "99999999999999999999"),
    ("agent", "--print", "--source", "inject", "--gpus", "99999999999"),
    ("simulate", "x.toml", "--out", "/nonexistent", "--seed", "-1"),
])
def test_bad_arguments_are_refused_before_anything_is_asked(args: tuple[str, ...]) -> None:
    code, out = cli(*args)
    assert code == 2, (args, out)
    assert "Invalid value" in out and "Traceback" not in out, (args, out)


class SlurmSays:
    """Slurm's answer about the job, as the CLI asks it before it sends the job's token: a job in
    ``state``, or ``raises`` (the job unknown, or Slurm not answering)."""

    def __init__(self, state: str = "RUNNING", raises: Exception | None = None, exit_code: int | None = None,
                 output: str = "") -> None:
        self.state, self.raises, self.exit_code, self.output = state, raises, exit_code, output

    def __call__(self) -> SlurmSays:  # stands in for the SlurmCli class
        return self

    def job_info(self, job_id: int) -> JobInfo:
        if self.raises is not None:
            raise self.raises
        return JobInfo(job_id, "train", self.state, ("node1",), "node1", "", "me", "gpu", exit_code=self.exit_code,
                       output=self.output)

    def list_steps(self, job_id: int) -> list[Any]:
        return []

    def list_jobs_named(self, name: str, user: str | None = None) -> list[Any]:
        return []

    def cancel_burst_jobs(self, job_id: int) -> list[int]:
        return []


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The job's state directory where the CLI looks first (no call to Slurm finds it); Slurm
    says the job runs."""
    monkeypatch.setattr(jobs, "SlurmCli", SlurmSays("RUNNING"))
    monkeypatch.setenv("SLURM_ELASTIC_HOME", str(tmp_path))
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "dev")
    path = tmp_path / "jobs" / "dev" / str(JOB)
    path.mkdir(parents=True)
    (path / "controller.json").write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": 1, "host": "x"}))
    (path / "token").write_text("t\n")
    return path


@pytest.mark.parametrize(("what", "damage", "says"), [
    ("an empty token file", {"token": ""}, "token file .*/token is empty"),
    ("a token file of blanks", {"token": " \n"}, "token file .*/token is empty"),
    ("no token file", {"token": None}, "token file .*/token is missing, and so is its copy"),
    ("controller.json not JSON", {"controller.json": "{not json"}, "cannot read .*/controller.json"),
    ("controller.json a list", {"controller.json": "[1]"}, "controller.json is not a controller file"),
    ("controller.json with a number for its URL", {"controller.json": '{"url": 5}'}, "no http:// URL"),
    ("controller.json with no URL scheme", {"controller.json": '{"url": "127.0.0.1:80"}'}, "no http:// URL"),
    ("controller.json with a pid that is no number", {"controller.json": '{"url": "http://h:1", "pid": "x"}'},
     "its pid is not a number"),
    ("controller.json with true for its pid", {"controller.json": '{"url": "http://h:1", "pid": true}'},
     "its pid is not a number"),
])
@pytest.mark.parametrize("command", ["pause", "stop"])
def test_a_damaged_state_directory_is_named_in_one_line(state_dir: Path, what: str, damage: dict[str, str | None],
                                                        says: str, command: str) -> None:
    for name, text in damage.items():
        if text is None:
            (state_dir / name).unlink()
        else:
            (state_dir / name).write_text(text)
    code, out = cli(command, str(JOB))
    assert code == 1 and "Traceback" not in out, (what, out)
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slurm-elastic: error: "), (what, out)
    assert re.search(says, lines[0]), (what, lines[0])


@pytest.mark.parametrize(("damage", "says"), [
    ({"token": None}, "token file .*/token is missing, and so is its copy"),
    ({"controller.json": "{not json"}, "cannot read .*/controller.json"),
])
def test_status_says_the_controller_was_not_asked_when_its_token_or_file_is_missing(
        state_dir: Path, damage: dict[str, str | None], says: str) -> None:
    """Nothing was sent: the table says NOT ASKED with the remedy, not that the controller is unreachable."""
    for name, text in damage.items():
        (state_dir / name).unlink() if text is None else (state_dir / name).write_text(text)
    code, out = cli("status", str(JOB))
    assert code == 3 and "controller: NOT ASKED (" in out and "UNREACHABLE" not in out, out
    assert re.search(says, out), out
    code, out = cli("status", "--json", str(JOB))
    doc = json.loads(out)
    assert doc["controller_not_asked"] and not doc["controller_reachable"] and re.search(says, doc["controller_error"])


class Running:
    """A controller running its loop (over a stub Slurm) behind the real server."""

    def __init__(self, tmp: Path) -> None:
        self.controller = Controller(parse_config({"agent": {"enabled": False}, "controller": {"tick_interval_s": 0.2}}),
                                     JOB, ListedSteps(), tmp, gpus_by_node={"node1": (0, 1)})
        self.server = ApiServer(create_controller_app(self.controller, TOKEN), "127.0.0.1")
        self.server.start()
        self.stop = threading.Event()
        self.loop = threading.Thread(target=self.controller.run_forever, args=(self.stop,), daemon=True)
        self.loop.start()

    def close(self) -> None:
        self.stop.set()
        self.loop.join(timeout=10)
        self.server.stop()


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    served = Running(tmp_path)
    yield served
    served.close()


def test_the_api_stops_the_controllers_loop(running: Running) -> None:
    with ControlClient(running.server.url, TOKEN) as client:
        assert client.stop() == {"stopping": True, "placeholders_released": []}
    running.loop.join(timeout=30)
    assert not running.loop.is_alive(), "the loop still runs after POST /admin/stop"
    assert not running.stop.is_set()  # it ended on the API's word, not the signal handlers'


def test_a_refused_field_is_said_in_words(running: Running) -> None:
    with ControlClient(running.server.url, TOKEN) as client, pytest.raises(ApiError) as refused:
        client.scale(1_000_000)
    assert str(refused.value).endswith("workers: Input should be less than or equal to 40000"), str(refused.value)
    no_token = httpx.post(running.server.url + "/admin/stop")
    assert no_token.status_code == 401
    assert running.loop.is_alive()


TRACE = Path(__file__).resolve().parents[2] / "examples" / "traces" / "phase_shift.toml"


@pytest.mark.parametrize(("what", "args", "says", "exit_code"), [
    ("a config that is not UTF-8", ("render", "--config", "{binary}"), "not UTF-8 text", 78),
    ("a config that is a directory", ("render", "--config", "{dir}"), "cannot read config file .*Is a directory", 78),
    ("a controller's config that is not UTF-8", ("controller", "--config", "{binary}"), "not UTF-8 text", 78),
    ("a trace that is not UTF-8", ("simulate", "{binary}", "--out", "{dir}/out"), "not UTF-8 text", 78),
    ("results where nothing can be written", ("simulate", str(TRACE), "--out", "{binary}/out", "--no-plot"),
     "cannot write the results to", 1),
])
def test_a_file_a_command_cannot_use_is_named_in_one_line(tmp_path: Path, what: str, args: tuple[str, ...],
                                                          says: str, exit_code: int) -> None:
    binary = tmp_path / "damaged.toml"
    binary.write_bytes(b"[workers]\nmax_workers = \xff\xfe\n")
    code, out = cli(*(a.format(binary=binary, dir=tmp_path) for a in args))
    assert code == exit_code and "Traceback" not in out, (what, out)
    assert re.search(says, out.strip().splitlines()[-1]), (what, out)


def test_the_token_survives_its_file_being_emptied_or_deleted(tmp_path: Path) -> None:
    """A controller restarted over an emptied or deleted token file takes the token back from its
    copy (workers and the trainer hold that one) and says so; one made anew where a controller
    ran before is said too."""
    (token,), path, note = ensure_token(tmp_path)
    assert token and note == "" and path.read_text().strip() == token
    assert oct(path.stat().st_mode & 0o777) == oct((tmp_path / TOKEN_COPY).stat().st_mode & 0o777) == "0o600"
    (tmp_path / "controller.json").write_text("{}")  # a controller ran here
    for damage in ("", " \n", b"\xff\xfe", None, "not a token"):
        if damage is None:
            path.unlink()
        elif isinstance(damage, bytes):
            path.write_bytes(damage)
        else:
            path.write_text(damage)
        again, _path, note = ensure_token(tmp_path)
        assert again == (token,) and path.read_text().strip() == token, damage
        assert "restored from .token.copy" in note, note
        assert read_token_file(path) == token
    (tmp_path / TOKEN_COPY).write_text("\x00garbled")  # the copy damaged instead: the file is kept
    again, _path, note = ensure_token(tmp_path)
    assert again == (token,) and (tmp_path / TOKEN_COPY).read_text().strip() == token and note == ""
    path.write_text("")
    (tmp_path / TOKEN_COPY).unlink()
    assert read_token_file(path) == ""
    (new,), _path, note = ensure_token(tmp_path)
    assert new != token and "a new token was made" in note and "refused (403)" in note


@pytest.mark.parametrize("changed", ["token", TOKEN_COPY])
def test_a_token_file_that_differs_from_its_copy_leaves_both_accepted(tmp_path: Path, changed: str) -> None:
    """One character changed in the file, or in its copy: nothing tells which one the clients
    hold, so both are accepted and both files kept. Before, the copy won: with the copy changed
    (a live re-check) the good file was overwritten, the trainer refused with 403 and the job failed."""
    (token,), path, _note = ensure_token(tmp_path)
    other = ("Q" if token[0] != "Q" else "R") + token[1:]
    (tmp_path / changed).write_text(other + "\n")
    tokens, _path, note = ensure_token(tmp_path)
    assert sorted(tokens) == sorted([token, other]) and "both tokens are accepted" in note
    assert {path.read_text().strip(), (tmp_path / TOKEN_COPY).read_text().strip()} == {token, other}
    guard = RequestGuard(tokens, submit_max_bytes=1 << 20)
    for accepted in (token, other):
        assert guard.check({"headers": [(b"authorization", f"Bearer {accepted}".encode())], "path": "/healthz",
                            "method": "GET"})[0] is None
    assert guard.check({"headers": [(b"authorization", b"Bearer " + token[::-1].encode())], "path": "/healthz",
                        "method": "GET"})[0] is not None


def test_commands_and_workers_read_the_token_from_its_copy(running: Running, state_dir: Path) -> None:
    (state_dir / "controller.json").write_text(json.dumps({"url": running.server.url, "pid": 1, "host": "x"}))
    (state_dir / "token").write_text("")
    (state_dir / TOKEN_COPY).write_text(TOKEN + "\n")
    code, out = cli("pause", str(JOB), "--json")
    assert code == 0 and json.loads(out) == {"paused": True}, out
    env = {"SLURM_ELASTIC_WORKER_ID": "0001", "SLURM_ELASTIC_CONTROLLER_URL": running.server.url,
           "SLURM_ELASTIC_TOKEN_FILE": str(state_dir / "token")}
    assert StepContext.from_env(env).token == TOKEN
    (state_dir / TOKEN_COPY).unlink()
    with pytest.raises(ConfigError, match=r"token file .* is missing or empty, and so is its copy"):
        StepContext.from_env(env)


def test_status_of_an_ended_job_says_so(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only 'controller did not answer' (which reads as a crash) for a job that is over."""
    monkeypatch.setattr(jobs, "SlurmCli", SlurmSays("COMPLETED"))
    code, out = cli("status", str(JOB))
    assert code == 3 and f"job {JOB} is COMPLETED in Slurm: no controller runs for it" in out, out
    monkeypatch.setattr(jobs, "SlurmCli", SlurmSays("COMPLETED", exit_code=0, output="/tmp/elastic-rl-7.out"))
    code, out = cli("status", str(JOB))  # the output file is named for a job that ended well too
    assert code == 3 and (f"job {JOB} is COMPLETED in Slurm (exit 0; its output: /tmp/elastic-rl-7.out): no "
                          "controller runs for it") in out, out


class SlurmLists(SlurmSays):
    """Slurm 22.05's ``squeue --json`` record of the job, read by the real parser."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__()
        self.record = record

    def job_info(self, job_id: int) -> JobInfo:
        return parse_jobs_json(json.dumps({"jobs": [{"job_id": job_id, **self.record}]}))[0]


def test_status_of_a_held_job_gives_its_reason_and_no_exit_code(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a held job read `PENDING in Slurm (exit 0; ...)` (22.05 reports 0 for a job that has
    not ended), and --json gave "job_exit_code": 0; its output is Slurm's default file."""
    monkeypatch.setattr(jobs, "SlurmCli", SlurmLists({"job_state": "PENDING", "state_reason": "JobHeldUser",
                                                      "exit_code": 0, "standard_output": "",
                                                      "current_working_directory": "/tmp/wd"}))
    code, out = cli("status", str(JOB))
    assert code == 3 and (f"job {JOB} is PENDING in Slurm (reason: JobHeldUser; its output: /tmp/wd/slurm-{JOB}.out): "
                          "no controller runs for it") in out, out
    code, out = cli("status", str(JOB), "--json")
    doc = json.loads(out)
    assert (doc["job_exit_code"], doc["job_reason"], doc["job_output"]) == (None, "JobHeldUser",
                                                                            f"/tmp/wd/slurm-{JOB}.out")


def test_status_of_a_job_whose_configuration_was_refused_points_at_its_output(
        state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, it said only that the job had FAILED (an operator's probe of a misspelt key)."""
    monkeypatch.setattr(jobs, "SlurmCli", SlurmSays("FAILED", exit_code=78, output="/tmp/elastic-rl-7.out"))
    code, out = cli("status", str(JOB))
    assert code == 3 and (f"job {JOB} is FAILED in Slurm (exit 78: the job's configuration was refused (by the "
                          "controller, or the batch script could not read it); its output says why: "
                          "/tmp/elastic-rl-7.out): no controller runs for it") in out, out


def test_uncordon_logs_the_operators_reason(running: Running, state_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`uncordon --reason` says "Why (logged)": the controller's log names the GPU, what was lifted and why."""
    (state_dir / "controller.json").write_text(json.dumps({"url": running.server.url, "pid": 1, "host": "x"}))
    (state_dir / "token").write_text(TOKEN + "\n")
    code, out = cli("cordon", str(JOB), "node1:1", "--reason", "fan noise")
    assert code == 0 and out == f"job {JOB}: node1:1 cordoned: no new worker is placed on it " \
                                f"(`slurm-elastic uncordon {JOB} node1:1` lifts it)\n", out
    code, out = cli("uncordon", str(JOB), "node1:1", "--reason", "fan replaced", "--json")
    assert code == 0 and json.loads(out)["cordoned"] is False, out
    lifted = [r.getMessage() for r in caplog.records if "uncordon node1:1" in r.getMessage()]
    assert lifted == ["uncordon node1:1 (operator) by operator: fan replaced"], [r.getMessage() for r in caplog.records]
    code, out = cli("uncordon", str(JOB), "node1:1")  # again: nothing to lift, and it says so
    assert code == 0 and "node1:1 was not cordoned: nothing lifted" in out, out


ENDED = f"job {JOB} ended ({{state}}): its controller is gone; not sending the job's token to {{url}}"


@pytest.mark.parametrize("state", ["COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"])
@pytest.mark.parametrize(("args", "exit_code"), [(("status",), 3), (("pause",), 1), (("scale", "{job}", "2"), 1),
                                                 (("wait-ready", "{job}", "--timeout-s", "30"), 1),
                                                 (("stop",), 0), (("cordon", "{job}", "node1:0"), 1)])
def test_an_ended_jobs_token_goes_nowhere(state_dir: Path, monkeypatch: pytest.MonkeyPatch, state: str,
                                          args: tuple[str, ...], exit_code: int) -> None:
    """Whatever listens now on the port an ended job's controller.json names gets nothing: every
    command asks Slurm first, and says why it sends nothing."""
    monkeypatch.setattr(jobs, "SlurmCli", SlurmSays(state))
    with recording_listener() as listener:
        (state_dir / "controller.json").write_text(json.dumps({"url": listener.url, "pid": 1, "host": "x"}))
        argv = [a.format(job=JOB) for a in args] if len(args) > 1 else [args[0], str(JOB)]
        code, out = cli(*argv)
    assert code == exit_code and ENDED.format(state=state, url=listener.url) in out and "Traceback" not in out, out
    assert listener.connections == 0 and listener.received == b""


def test_a_job_not_started_again_gets_no_token_and_is_waited_for(state_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A requeued job is PENDING with its earlier run's controller.json: nothing is sent there,
    and `wait-ready` keeps waiting (the controller comes when the job starts again)."""
    monkeypatch.setattr(jobs, "SlurmCli", SlurmSays("PENDING"))
    with recording_listener() as listener:
        (state_dir / "controller.json").write_text(json.dumps({"url": listener.url, "pid": 1, "host": "x"}))
        code, out = cli("wait-ready", str(JOB), "--timeout-s", "0")
        assert code == 1 and "timed out after 0 s waiting for the controller" in out, out
        assert f"job {JOB} is PENDING: its controller does not run (yet, or again after a requeue)" in out
        assert cli("pause", str(JOB))[0] == 1
    assert listener.connections == 0 and listener.received == b""


def test_a_job_unknown_to_slurm_gets_no_token(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Long finished (gone from Slurm's memory) while its state directory stays."""
    gone = SlurmError(f"job {JOB} is unknown to Slurm (finished long ago, or never existed)")
    monkeypatch.setattr(jobs, "SlurmCli", SlurmSays(raises=gone))
    with recording_listener() as listener:
        (state_dir / "controller.json").write_text(json.dumps({"url": listener.url, "pid": 1, "host": "x"}))
        for command in ("status", "pause"):
            code, out = cli(command, str(JOB))
            assert code == 1 and str(gone) in out, out
    assert listener.connections == 0


def test_with_slurm_down_the_controller_file_is_trusted_and_that_is_said(running: Running, state_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """slurmctld down: the controller, made to run through that, still answers the operator; the
    warning says the token went out on the word of controller.json alone."""
    monkeypatch.setattr(jobs, "SlurmCli", SlurmSays(raises=SlurmUnavailableError("Unable to contact slurm controller")))
    (state_dir / "controller.json").write_text(json.dumps({"url": running.server.url, "pid": 1, "host": "x"}))
    (state_dir / "token").write_text(TOKEN + "\n")
    result = CliRunner().invoke(main, ["pause", str(JOB)])
    assert result.exit_code == 0 and result.stdout == (f"job {JOB}: autoscaling paused: the worker count stays at its "
                                                       f"target (`slurm-elastic resume {JOB}`)\n"), result.output
    assert result.stderr == (f"warning: Slurm did not answer: Unable to contact slurm controller; sending the job's "
                             f"token to {running.server.url} on the word of {state_dir}/controller.json alone\n")
    code, out = cli("status", str(JOB))
    assert code == 0 and "warning: Slurm did not answer" in out, out


def test_stop_says_which_steps_still_hold_the_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller is gone, but the trainer's step runs on: the job keeps its nodes until it ends."""
    from slurm_elastic.slurm.parse import StepInfo

    class Slurm:
        def cancel_burst_jobs(self, job_id: int) -> list[int]:
            return []

        def list_steps(self, job_id: int) -> list[StepInfo]:
            return [StepInfo(job_id, step, name, ("node1",), "1:00", "", "", 1)
                    for step, name in [("batch", "batch"), ("0", "se-agent-node1"), ("2", "trainer"), ("5", "se-w-0001")]]

    class Client:
        def __enter__(self) -> Client:
            return self

        def __exit__(self, *_exc: object) -> None:
            return None

        def scale(self, workers: int) -> dict[str, Any]:
            return {}

    monkeypatch.setattr(jobs, "_client", lambda *a, **k: (None, Client()))
    monkeypatch.setattr(jobs, "wait_for_status", lambda *a: {})
    monkeypatch.setattr(jobs, "_stop_controller", lambda job_id: ["0007"])
    monkeypatch.setattr(jobs, "SlurmCli", Slurm)
    result = CliRunner().invoke(main, ["stop", "77"])
    assert result.exit_code == 0 and ("job 77: workers drained, controller stopped, placeholders 0007 released "
                                      "(their steps cancelled)") in result.output
    assert ("job 77 still holds its allocation: steps 77.2 (trainer) still run; they end by themselves"
            in result.output) and "`scancel 77` ends the job now" in result.output  # agents end with the job


def test_an_uncordon_that_leaves_a_slurm_cordon_says_what_lifts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    answer = {"node": "node2", "gpu": 1, "cordoned": True, "reason": "Slurm marks node node2 DRAIN", "source": "slurm",
              "lifted": ["operator"]}
    monkeypatch.setattr(worker_pool, "call_controller", lambda *a: answer)
    result = CliRunner().invoke(main, ["uncordon", "77", "node2:1"])
    assert result.exit_code == 1 and result.stdout == "job 77: node2:1: lifted its operator cordon; it stays cordoned\n"
    assert "node2:1 stays cordoned: Slurm marks node node2 DRAIN" in result.stderr
    assert "scontrol update nodename=node2 state=resume" in result.stderr


def test_a_gpu_ref_error_says_it_once_and_a_node_range_is_named() -> None:
    result = CliRunner().invoke(main, ["cordon", "77", "node1:-1"])
    assert result.exit_code == 2 and result.output.count("NODE:GPU (e.g. node1:2)") == 1
    result = CliRunner().invoke(main, ["cordon", "77", "node[1-2]:0"])
    assert result.exit_code == 2 and "'node[1-2]' is not one node's name" in result.output


@pytest.mark.parametrize(("args", "names"), [
    (("status", "\uff11\uff12"), "JOB_ID"),  # fullwidth 12: before, job 12
    (("status", "1_2"), "JOB_ID"),
    (("status", " 12"), "JOB_ID"),
    (("scale", "77", "\u0663"), "WORKERS"),  # Arabic-Indic 3
    (("cordon", "77", "node1:\u0663"), "NODE:GPU"),  # before, node1:3 was cordoned
    (("uncordon", "\u0667\u0667", "node1:3"), "JOB_ID"),
    (("drain", "77", "\u0660\u0660\u0660\u0663"), "WORKER_ID"),
    (("stop", "77", "--drain-timeout-s", "\u0663\u0660"), "--drain-timeout-s"),
    (("scale", "77", "2", "--wait", "--timeout-s", "1_0"), "--timeout-s"),
])
def test_every_number_is_taken_in_ascii_digits_only(monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...],
                                                    names: str) -> None:
    """Python's int() and float() read other scripts' digits: `cordon J node1:\u0663` cordoned
    node1:3 and `status \uff11\uff12` meant job 12, while `drain` refused them. Now each is refused,
    the argument named, before anything is asked."""
    monkeypatch.setattr(worker_pool, "call_controller", lambda *a: pytest.fail("asked the controller"))
    monkeypatch.setattr(jobs, "SlurmCli", SlurmSays(raises=AssertionError("asked Slurm")))
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 2 and re.search(f"Invalid value for '?{names}'?: .*ASCII digits", result.output), \
        result.output


def test_a_negative_count_gets_the_ranges_message() -> None:
    result = CliRunner().invoke(main, ["scale", "77", "-1"])
    assert result.exit_code == 2 and "-1 is not in the range 0<=x<=40000" in result.output


def test_a_worker_id_without_its_leading_zeros_names_the_same_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[Any, ...]] = []
    monkeypatch.setattr(worker_pool, "call_controller", lambda *a: asked.append(a) or {"worker_id": a[2], "draining": True})
    assert CliRunner().invoke(main, ["drain", "77", "3"]).exit_code == 0
    assert CliRunner().invoke(main, ["drain", "77", "se-w-0011"]).exit_code == 0  # as squeue names the step
    assert asked == [(77, "drain", "0003"), (77, "drain", "0011")]


def test_scale_wait_says_when_fewer_than_asked_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_pool, "call_controller", lambda *a: {"target_workers": 5})
    monkeypatch.setattr(worker_pool, "wait_for_status", lambda *a: {"workers_by_state": {"ACTIVE": 2}, "usable_slots": 2})
    result = CliRunner().invoke(main, ["scale", "77", "5", "--wait"])
    assert result.exit_code == 0 and "only 2 of the 5 asked: every usable GPU slot has a worker" in result.output


def test_scale_wait_with_every_gpu_cordoned_is_settled_at_once() -> None:
    """No usable GPU slot: nothing can start, so there is nothing to wait for (it waited its
    whole timeout, 300 s by default); before the first tick nothing is known yet."""
    assert worker_pool._settled({"workers_by_state": {"ACTIVE": 0}, "usable_slots": 0}, 2)
    assert not worker_pool._settled({"workers_by_state": {"ACTIVE": 0}, "usable_slots": None}, 2)
    assert not worker_pool._settled({"workers_by_state": {"ACTIVE": 1}, "usable_slots": 4}, 2)
    # a worker in BACKOFF whose GPU is crash-cordoned has no slot to come back to (a live audit: the
    # wait ran out its whole timeout); one whose GPU is usable still holds it
    assert worker_pool._settled({"workers_by_state": {"ACTIVE": 1, "BACKOFF": 2}, "usable_slots": 1}, 3)
    assert not worker_pool._settled({"workers_by_state": {"ACTIVE": 1, "BACKOFF": 1}, "usable_slots": 2}, 2)


def test_status_says_the_autoscaler_is_off_when_it_is() -> None:
    from slurm_elastic.status_view import render_status

    ctl = {"target_workers": 2, "last_decision": {"action": "hold",
                                                  "reason": "autoscaler disabled ([autoscaler] enabled = false)"}}
    assert "target: 2 workers (autoscaler disabled)" in render_status(77, {"controller": ctl})
