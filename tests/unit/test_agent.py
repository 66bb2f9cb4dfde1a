"""The agent against a real HTTP server on 127.0.0.1: bearer token, report body, survival."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.client.wire import AgentReportBody
from slurm_elastic.core.cordons import CordonBook
from slurm_elastic.errors import EXIT_CONFIG
from slurm_elastic.gpu import agent as agent_module
from slurm_elastic.gpu.agent import Agent, AutoSource, ReportPoster, build_report, make_source
from slurm_elastic.gpu.injection import InjectionSource
from slurm_elastic.gpu.nvml import NvmlSource
from slurm_elastic.gpu.source import Reading


class Recorder(BaseHTTPRequestHandler):
    received: list[dict[str, Any]]
    status = 200

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.append(  # type: ignore[attr-defined]
            {"path": self.path, "auth": self.headers.get("Authorization"), "body": json.loads(body)}
        )
        self.send_response(self.server.status)  # type: ignore[attr-defined]
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    srv.received = []  # type: ignore[attr-defined]
    srv.status = 200  # type: ignore[attr-defined]
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def url(srv: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    p = tmp_path / "token"
    p.write_text("s3cret\n")
    return p


def drill_file(tmp_path: Path) -> Path:
    f = tmp_path / "inject.toml"
    f.write_text(
        '[baseline]\ngpus = 2\n[[fault]]\nnode = "node1"\ngpu = 1\nreasons = ["hw_thermal_slowdown"]\n'
    )
    return f


def test_agent_posts_report_with_bearer_token(
    server: ThreadingHTTPServer, token_file: Path, tmp_path: Path
) -> None:
    src = InjectionSource("node1", drill_file(tmp_path), env={})
    agent = Agent(src, ReportPoster(url(server), str(token_file)), "node1", clock=lambda: 500.0)
    assert agent.run_once() is True
    [req] = server.received  # type: ignore[attr-defined]
    assert req["path"] == "/agent/report" and req["auth"] == "Bearer s3cret"
    report = AgentReportBody.model_validate(req["body"]).to_core()
    assert (report.node, report.sampled_at_s, report.source) == ("node1", 500.0, "inject")
    # the controller side: the throttled GPU gets cordoned and drained
    book = CordonBook()
    book.observe_report(report, 500.0)
    assert set(book.cordoned()) == {("node1", 1)} and book.drain_targets() == {("node1", 1)}
    agent.poster.close()


def test_agent_survives_controller_down_with_backoff(token_file: Path, tmp_path: Path) -> None:
    src = InjectionSource("node1", None, gpus=1, env={})
    poster = ReportPoster(f"http://127.0.0.1:{free_port()}", str(token_file), timeout_s=2.0)
    delays: list[float] = []

    def wait(delay_s: float) -> bool:
        delays.append(delay_s)
        return len(delays) >= 5

    agent = Agent(src, poster, "node1", interval_s=2.0, max_backoff_s=10.0, wait=wait)
    assert agent.run() == 0
    assert delays == [4.0, 8.0, 10.0, 10.0, 10.0]
    assert agent.failures == 5


def test_agent_recovers_when_controller_comes_back(
    server: ThreadingHTTPServer, token_file: Path
) -> None:
    server.status = 503  # type: ignore[attr-defined]
    src = InjectionSource("node1", None, gpus=1, env={})
    delays: list[float] = []

    def wait(delay_s: float) -> bool:
        delays.append(delay_s)
        server.status = 200  # type: ignore[attr-defined]
        return len(delays) >= 3

    agent = Agent(
        src, ReportPoster(url(server), str(token_file)), "node1", interval_s=1.0, wait=wait
    )
    agent.run()
    assert delays == [2.0, 1.0, 1.0]
    assert len(server.received) == 3  # type: ignore[attr-defined]


def test_stop_flag_ends_the_loop(server: ThreadingHTTPServer, token_file: Path) -> None:
    src = InjectionSource("node1", None, gpus=1, env={})
    agent = Agent(src, ReportPoster(url(server), str(token_file)), "node1", interval_s=3600.0)
    agent.stop.set()  # what the SIGTERM handler does
    assert agent.run() == 0
    assert server.received == []  # type: ignore[attr-defined]


def test_a_drain_signal_to_the_whole_job_leaves_the_agent_sampling(token_file: Path) -> None:
    """``scancel --signal=USR1 JOB`` reaches the agent's step too: it has nothing to drain."""
    agent = Agent(InjectionSource("node1", None, gpus=1, env={}), ReportPoster("http://127.0.0.1:9", str(token_file)),
                  "node1", interval_s=3600.0)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        agent.install_signal_handlers()
        for signum in (signal.SIGUSR1, signal.SIGUSR2):
            os.kill(os.getpid(), signum)  # the default action would end this process
        assert not agent.stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert agent.stop.is_set()
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def test_missing_token_file_is_a_failed_round_not_a_crash(
    server: ThreadingHTTPServer, tmp_path: Path
) -> None:
    src = InjectionSource("node1", None, gpus=1, env={})
    agent = Agent(src, ReportPoster(url(server), str(tmp_path / "nope")), "node1")
    assert agent.run_once() is False and agent.failures == 1


class Exploding:
    name = "boom"

    def sample(self, now_s: float) -> Reading:
        raise RuntimeError("driver fell over")

    def close(self) -> None:
        pass


def test_a_failing_source_still_gives_a_report() -> None:
    report = build_report(Exploding(), "node1", 1.0)
    assert report.gpus == [] and "driver fell over" in report.errors[0]


class NoNvml:
    def nvmlInit(self) -> None:
        raise OSError("libnvidia-ml.so.1 not found")


def test_auto_falls_back_to_injection_when_nvml_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_module, "NVIDIA_CONTROL_DEVICE", tmp_path / "no-nvidiactl")  # a node without a driver
    inject = InjectionSource("node1", drill_file(tmp_path), env={})
    auto = AutoSource(NvmlSource("node1", NoNvml(), env={}), inject)
    assert len(auto.sample(0.0).gpus) == 2 and auto.name == "inject"
    alone = AutoSource(NvmlSource("node1", NoNvml(), env={}), None)
    reading = alone.sample(0.0)
    assert reading.gpus == [] and "NVML init failed" in reading.errors[0]
    assert make_source("inject", "n", None, 3).sample(0.0).gpus[2].index == 2


def test_auto_stays_with_a_failing_nvml_on_a_node_with_a_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "nvidiactl").touch()
    monkeypatch.setattr(agent_module, "NVIDIA_CONTROL_DEVICE", tmp_path / "nvidiactl")
    auto = AutoSource(NvmlSource("node1", NoNvml(), env={}), InjectionSource("node1", drill_file(tmp_path), env={}))
    reading = auto.sample(0.0)
    assert reading.gpus == [] and "NVML init failed" in reading.errors[0]  # never fake-healthy


def test_cli_print_and_once(server: ThreadingHTTPServer, token_file: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    f = drill_file(tmp_path)
    res = runner.invoke(
        main, ["agent", "--print", "--source", "inject", "--inject-file", str(f), "--node", "node1"]
    )
    assert res.exit_code == 0, res.output
    body = json.loads(res.output)
    assert body["gpus"][1]["clock_event_reasons"] == ["hw_thermal_slowdown"]
    args = ["agent", "--once", "--source", "inject", "--node", "node1", "--gpus", "1"]
    res = runner.invoke(
        main, [*args, "--controller-url", url(server), "--token-file", str(token_file)]
    )
    assert res.exit_code == 0, res.output
    assert len(server.received) == 1  # type: ignore[attr-defined]
    res = runner.invoke(
        main,
        [
            *args,
            "--controller-url",
            f"http://127.0.0.1:{free_port()}",
            "--token-file",
            str(token_file),
        ],
    )
    assert res.exit_code == 1
    res = runner.invoke(main, [*args, "--token-file", str(token_file)])
    assert res.exit_code == EXIT_CONFIG and "--controller-url" in res.output


def test_the_controller_route_takes_the_agents_report_and_refuses_a_bad_one_naming_the_field(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from slurm_elastic.client.wire import report_json
    from slurm_elastic.controller.app import create_controller_app
    from slurm_elastic.controller.config import parse_config
    from slurm_elastic.controller.runtime import Controller
    from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
    from slurm_elastic.rollouts.store import RolloutStore
    from slurm_elastic.slurm.cli_backend import SlurmCli

    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    queue = RolloutQueue(RolloutStore(tmp_path / "q.sqlite"), QueueConfig())
    controller = Controller(config, 1, SlurmCli(timeout_s=5), tmp_path, gpus_by_node={"node1": (0, 1)}, queue=queue)
    client = TestClient(create_controller_app(controller, "t", queue), headers={"Authorization": "Bearer t"})
    report = report_json(build_report(InjectionSource("node1", drill_file(tmp_path), env={}), "node1", 5.0))
    answer = client.post("/agent/report", json=report)
    assert answer.status_code == 200 and [c["gpu"] for c in answer.json()["changes"]] == [1]
    assert set(controller.cordoned_gpus()) == {("node1", 1)}
    for field, value in (("lost", "no"), ("index", -1), ("temperature_c", "hot"), ("bogus", 1)):
        bad = {**report, "gpus": [{**report["gpus"][0], field: value}]}
        refused = client.post("/agent/report", json=bad)
        assert refused.status_code == 422 and field in refused.text, (field, refused.text)
    other_node = {**report, "gpus": [{**report["gpus"][0], "node": "node2"}]}
    refused = client.post("/agent/report", json=other_node)
    assert refused.status_code == 422 and "names node 'node2'" in refused.text
    assert client.post("/agent/report", json={**report, "node": "node9", "gpus": []}).status_code == 404
    queue.store.close()


def test_an_agent_report_is_answered_in_front_of_the_framework_and_by_the_route_while_a_tick_runs(tmp_path: Path) -> None:
    """The fast path (half the CPU of the route per report) answers what the route answers; with the lock held
    by a tick it leaves the report to the route, which waits for the lock."""
    from fastapi.testclient import TestClient

    from slurm_elastic.client.wire import report_json
    from slurm_elastic.controller.app import create_controller_app
    from slurm_elastic.controller.beats import AgentReportEndpoint
    from slurm_elastic.controller.config import parse_config
    from slurm_elastic.controller.runtime import Controller
    from slurm_elastic.slurm.cli_backend import SlurmCli
    from tests.stub_backend import lock_held_elsewhere

    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    controller = Controller(config, 1, SlurmCli(timeout_s=5), tmp_path, gpus_by_node={"node1": (0, 1)})
    client = TestClient(create_controller_app(controller, "t"), headers={"Authorization": "Bearer t"})
    report = report_json(build_report(InjectionSource("node1", drill_file(tmp_path), env={}), "node1", 5.0))
    endpoint = AgentReportEndpoint(controller)
    body = json.dumps(report).encode()
    fast = endpoint.answer(body)
    assert fast is not None and fast[0] == 200 and [c["gpu"] for c in json.loads(fast[1])["changes"]] == [1]
    assert endpoint.answer(json.dumps({**report, "node": "node9", "gpus": []}).encode()) is None  # the route's 404
    assert endpoint.answer(b'{"node": "node1"}') is None  # the route's 422
    answered: list[Any] = []
    with lock_held_elsewhere(controller.lock):
        assert endpoint.answer(body) is None
        poster = threading.Thread(target=lambda: answered.append(client.post("/agent/report", content=body)))
        poster.start()
        poster.join(0.5)
        assert not answered  # the route waits for the tick
    poster.join(30)
    assert answered[0].status_code == 200 and answered[0].json() == {"node": "node1", "changes": []}
    again = endpoint.answer(body)
    assert again is not None and json.loads(again[1]) == {"node": "node1", "changes": []}
    deep = body[:-1] + b', "ignored": ' + b"[" * 200 + b"]" * 200 + b"}"  # 201 levels, in a key the model ignores
    refused = client.post("/agent/report", content=deep)  # refused as the routes refuse it, not taken by the fast path
    assert refused.status_code == 422 and refused.json()["detail"][0]["type"] == "json_invalid"
