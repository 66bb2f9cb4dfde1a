"""The ``/endpoints`` long-poll on the real HTTP server over a real server-kind controller: it
answers as soon as the routable set changes (a server registering ready, through the API), and
while nothing changes it waits without looking at the controller again."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slurm_elastic.client.control import ControlClient
from slurm_elastic.core.lifecycle import Worker
from slurm_elastic.errors import ApiError
from tests.unit.served_controller import ServedController

TOKEN = "long-poll-token"


class Served(ServedController):
    def __init__(self, state: Path) -> None:
        super().__init__(state, TOKEN, {"autoscaler": {"min_workers": 0},
                                        "workers": {"kind": "server", "command": ["engine", "{port}"]}})
        self.views = 0
        view = self.controller.endpoints_view

        def counted(latest_weights_only: bool = False) -> dict[str, Any]:
            self.views += 1
            return view(latest_weights_only)
        self.controller.endpoints_view = counted  # type: ignore[method-assign]
        self.client = ControlClient(self.url, TOKEN)

    def close(self) -> None:
        self.client.close()
        super().close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    job = Served(tmp_path)
    yield job
    job.close()


def test_a_long_poll_answers_when_a_server_becomes_routable(served: Served) -> None:
    version = served.client.endpoints()["version"]
    answers: list[dict[str, Any]] = []
    poll = threading.Thread(target=lambda: answers.append(served.client.endpoints(version, wait_s=60)))
    poll.start()
    while served.views < 2:  # the poll has looked once
        time.sleep(0.01)
    with served.controller.lock:
        served.controller.workers["0001"] = Worker("0001", launched_at_s=time.time())
    served.client.register("0001", {"node": "node1", "gpus": [0], "step_id": "1", "ready": True,
                                    "endpoint": "http://127.0.0.1:1"})
    poll.join(timeout=60)
    assert answers and answers[0]["version"] != version, "the long-poll did not answer on the change"
    assert [e["worker_id"] for e in answers[0]["endpoints"]] == ["0001"]


def test_a_long_poll_with_nothing_changing_does_not_keep_looking(served: Served) -> None:
    version = served.client.endpoints()["version"]
    before = served.views
    assert served.client.endpoints(version, wait_s=1.0)["version"] == version
    assert served.views - before <= 2, f"looked at the controller {served.views - before} times in one wait"


def test_a_long_poll_whose_client_left_ends_with_it(served: Served) -> None:
    """A client that sends a 60 s poll and closes its socket leaves no poll waiting behind it (each
    would be woken by every change, and their number is not bounded by the connection cap)."""
    version = served.client.endpoints()["version"]
    host, port = served.url.removeprefix("http://").split(":")
    for _ in range(50):
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(f"GET /endpoints?version={version}&wait_s=60 HTTP/1.1\r\nhost: x\r\n"
                         f"authorization: Bearer {TOKEN}\r\n\r\n".encode())
            time.sleep(0.01)
    deadline = time.monotonic() + 10
    while served.controller.endpoints_changed.waiting() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.controller.endpoints_changed.waiting() == 0


def test_polls_past_the_cap_are_answered_at_once(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client holding thousands of long-polls would take every connection of the cap (a request
    in progress is never the one closed), and workers' heartbeats would find none: past
    MAX_LONG_POLLS a poll that would wait gets 503 with Retry-After, at once (an answer at once
    with the same view made clients that poll again at once a busy loop). One that would not wait
    is answered: before, every poll with ``wait_s`` got 503, and a new Router found no server."""
    from slurm_elastic.controller import http

    monkeypatch.setattr(http, "MAX_LONG_POLLS", 3)
    version = served.client.endpoints()["version"]
    clients = [ControlClient(served.url, TOKEN) for _ in range(3)]
    waiting = [threading.Thread(target=lambda c=c: c.endpoints(version, wait_s=30)) for c in clients]
    for poll in waiting:
        poll.start()
    try:
        deadline = time.monotonic() + 10
        while served.controller.endpoints_changed.waiting() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert served.controller.endpoints_changed.waiting() == 3
        started = time.monotonic()
        with pytest.raises(ApiError) as refused:
            served.client.endpoints(version, wait_s=30)
        assert time.monotonic() - started < 5, "a poll past the cap waited"
        assert refused.value.status_code == 503 and "3 polls wait already" in str(refused.value)
        assert served.client.endpoints(version)["version"] == version  # a poll that does not wait is answered
        # nor does one whose version is not the current one (a new router's first poll): answered
        assert served.client.endpoints(-1, wait_s=30)["version"] == version
        assert served.client.endpoints(version - 1, wait_s=30)["version"] == version
    finally:
        with served.controller.lock:
            served.controller.workers["0001"] = Worker("0001", launched_at_s=time.time())
        served.client.register("0001", {"node": "node1", "gpus": [0], "step_id": "1", "ready": True,
                                        "endpoint": "http://127.0.0.1:1"})  # a change ends the waiting polls
        for poll in waiting:
            poll.join(timeout=30)
        for client in clients:
            client.close()


@pytest.mark.parametrize(("header", "unchanged"), [
    ('"{v}"', True), ('W/"{v}"', True), ('"x", W/"{v}"', True), ("*", True), ('"{w}"', False), ("", False)])
def test_if_none_match_takes_lists_weak_tags_and_a_star(served: Served, header: str, unchanged: bool) -> None:
    """RFC 9110: ``*``, a list, and weak tags (compared weakly); before, only the exact tag gave 304."""
    version = served.client.endpoints()["version"]
    answer = httpx.get(served.url + "/endpoints", timeout=10, headers={
        "Authorization": f"Bearer {TOKEN}", "If-None-Match": header.format(v=version, w=version + 1)})
    assert answer.status_code == (304 if unchanged else 200)
