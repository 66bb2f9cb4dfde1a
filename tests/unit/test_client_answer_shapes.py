"""The SDK and the trainer helper as clients of a server at the controller's address that answers
200 with a JSON object of another shape (another service's API, a stub): before, a submit
answered ``{"ok": true}`` returned that as its answer (the group counted as handed over, never
stored), an admission answered ``{"granted": -1}`` or ``1e300`` handed that to the worker, and a
pull without ``batch_id`` or ``groups`` raised KeyError or TypeError out of the trainer after
dropping the pull's id. Each is now a :class:`ControllerAnswerError` naming the key (a
:class:`ControllerUnreachableError`: the worker keeps its group, the trainer its pull id, and both
read ``controller.json`` again)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.client.control import ControlClient
from slurm_elastic.controller.files import publish
from slurm_elastic.errors import ControllerAnswerError
from slurm_elastic.trainer import Trainer
from slurm_elastic.worker import RolloutWorker
from tests.unit.served_controller import ServedController

TOKEN = "answer-shapes-token"
GROUP = {"id": "g1", "policy_version": 0, "group_size": 1, "sequences": [{"tokens": [1, 2], "score": 1.0}]}


class Stub(BaseHTTPRequestHandler):
    """Answers every request 200 with ``self.server.body``."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *_args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body: bytes = self.server.body  # type: ignore[attr-defined]
        self.server.calls += 1  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def stub() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    server.daemon_threads = True
    server.body, server.calls = b'{"ok": true}', 0  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


CALLS: dict[str, Callable[[ControlClient], Any]] = {
    "submit": lambda c: c.submit_group(GROUP, max_wait_s=0.0, sleep=lambda _s: None),
    "admit": lambda c: c.admit(2, "0001"),
    "release": lambda c: c.release_admission(2, "0001", "r1"),
    "register": lambda c: c.trainer_register(),
    "pull": lambda c: c.pull_batch("p1"),
}


@pytest.mark.parametrize(("call", "body", "says"), [
    ("submit", b'{"ok": true}', "no accepted"), ("submit", b'{"accepted": "yes"}', "accepted='yes'"),
    ("admit", b'{"ok": true}', "no granted"), ("admit", b'{"granted": -1}', "granted='-1'"),
    ("admit", b'{"granted": 1e300}', "granted='1e+300'"), ("admit", b'{"granted": 3}', "granted='3'"),
    ("admit", b'{"granted": true}', "granted='True'"), ("admit", b'{"granted": "2"}', "granted='2'"),
    ("release", b'{"released": null}', "released='None'"),
    ("register", b'{"trainer_session": "x"}', "trainer_session='x'"),
    ("register", b'{"trainer_session": 0}', "trainer_session='0'"),
    ("pull", b'{"ok": true}', "no batch_id"), ("pull", b'{"batch_id": "b", "groups": 3, "lost_group_ids": []}',
                                                "groups='3'"),
    ("pull", b'{"batch_id": "b", "groups": [1], "lost_group_ids": []}', "a group that is not a JSON object"),
])
def test_an_answer_of_another_shape_is_not_the_controllers(stub: ThreadingHTTPServer, call: str, body: bytes,
                                                          says: str) -> None:
    stub.body = body  # type: ignore[attr-defined]
    with ControlClient(url(stub), TOKEN, timeout_s=2.0) as client, pytest.raises(ControllerAnswerError) as caught:
        CALLS[call](client)
    assert says in str(caught.value)


def test_a_pull_answer_without_lost_group_ids_is_an_older_controllers(stub: ThreadingHTTPServer) -> None:
    """A controller older than ``lost_group_ids`` leaves it out: no group lost (the trainer reads it so)."""
    stub.body = b'{"batch_id": "b", "groups": [{"id": "g1"}]}'  # type: ignore[attr-defined]
    with ControlClient(url(stub), TOKEN, timeout_s=2.0) as client:
        assert client.pull_batch("p1") == {"batch_id": "b", "groups": [{"id": "g1"}], "lost_group_ids": []}
    stub.body = b'{"batch_id": "b", "groups": [], "lost_group_ids": "g1"}'  # type: ignore[attr-defined]
    with ControlClient(url(stub), TOKEN, timeout_s=2.0) as client, pytest.raises(ControllerAnswerError,
                                                                                 match="lost_group_ids='g1'"):
        client.pull_batch("p1")


def test_the_controllers_own_shapes_pass(tmp_path: Path) -> None:
    served = ServedController(tmp_path, TOKEN, {"autoscaler": {"min_workers": 0}}, batch_size=1).launched("0001")
    try:
        with ControlClient(served.url, TOKEN) as client:
            assert client.trainer_register()["trainer_session"] >= 1
            assert client.admit(2, "0001")["granted"] == 2
            assert client.release_admission(1, "0001", "r1")["released"] == 1
            assert client.submit_group({**GROUP, "worker_id": "0001"})["accepted"] is True
            assert [g["id"] for g in client.pull_batch("p1")["groups"]] == ["g1"]  # type: ignore[index]
            assert client.pull_batch("p2") is None
    finally:
        served.close()


def test_a_worker_keeps_its_group_past_a_stub_until_controller_json_names_the_controller(
        stub: ThreadingHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"SLURM_ELASTIC_WORKER_ID": "0001", "SLURM_ELASTIC_CONTROLLER_URL": url(stub),
                        "SLURM_ELASTIC_TOKEN": TOKEN, "SLURM_ELASTIC_STATE_DIR": str(tmp_path),
                        "SLURM_ELASTIC_HEARTBEAT_INTERVAL_S": "0.2"}.items():
        monkeypatch.setenv(name, value)
    served = ServedController(tmp_path, TOKEN, {"autoscaler": {"min_workers": 0}}, batch_size=1).launched("0001")
    try:
        with RolloutWorker.from_env() as worker:
            threading.Timer(1.0, publish, (tmp_path, served.url, 1)).start()
            answer = worker.submit(GROUP)
        assert answer["accepted"] is True and stub.calls >= 1  # type: ignore[attr-defined]
        assert served.queue.stats()["queued_groups"] == 1
    finally:
        served.close()


def test_a_trainer_keeps_its_pull_past_a_stub(stub: ThreadingHTTPServer, tmp_path: Path) -> None:
    served = ServedController(tmp_path, TOKEN, {"autoscaler": {"min_workers": 0}}, batch_size=1)
    try:
        served.queue.submit("g1", "0001", 1, 0, b'{"id":"g1","worker_id":"0001","policy_version":0,"group_size":1,'
                                                b'"sequences":[{"tokens":[1],"score":1.0}]}')
        trainer = Trainer(url(stub), TOKEN, state_dir=tmp_path, poll_s=0.05)  # {"ok": true}: a session not issued
        try:
            publish(tmp_path, served.url, 1)
            batch = trainer.next_batch(timeout_s=10)
            assert batch is not None and [g["id"] for g in batch.groups] == ["g1"]
            trainer.ack(batch)
        finally:
            trainer.close()
        assert stub.calls >= 2  # type: ignore[attr-defined]
    finally:
        served.close()
