"""client/follow.FollowedClient: what makes a line follow a moved controller, and what does not
stop it following (a damaged controller.json, a failed read, a close racing a refresh)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from slurm_elastic.client import follow as follow_mod
from slurm_elastic.client.follow import FollowedClient, usable_url


class Fake:
    def __init__(self, url: str, token: str) -> None:
        self.url, self.closed = url.rstrip("/"), False

    def close(self) -> None:
        self.closed = True


def write(state: Path, url: str) -> None:
    tmp = state / "controller.json.tmp"
    tmp.write_text(json.dumps({"url": url, "pid": 1}))
    tmp.replace(state / "controller.json")


@pytest.mark.parametrize(("url", "usable"), [
    ("http://node1:8080/", "http://node1:8080"), ("https://node1", "https://node1"),
    ("http://node1:port", None), ("ftp://node1:21", None), ("", None), ("node1:8080", None),
    ("http://" + "a" * 70 + ":1", None),  # a host label over 63 characters: no name lookup can take it
])
def test_a_url_is_usable_only_if_a_connection_can_be_made_to_it(url: str, usable: str | None) -> None:
    assert usable_url(url) == usable


def test_a_failed_read_of_controller_json_is_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read error (a shared file system's ESTALE or EIO, say) must not make the file's stat
    look read: the controller writes it once, so the line would never follow."""
    write(tmp_path, "http://127.0.0.1:1")
    line = FollowedClient("http://127.0.0.1:1", "t", tmp_path, Fake)
    assert line.refresh() is False
    write(tmp_path, "http://127.0.0.1:2")
    real = follow_mod.read_controller_url
    monkeypatch.setattr(follow_mod, "read_controller_url", lambda d: "")
    assert line.refresh() is False
    monkeypatch.setattr(follow_mod, "read_controller_url", real)
    assert line.refresh() is True and line.client.url == "http://127.0.0.1:2"


def test_a_damaged_controller_json_is_not_followed_and_its_repair_is(tmp_path: Path) -> None:
    write(tmp_path, "http://127.0.0.1:1")
    line = FollowedClient("http://127.0.0.1:1", "t", tmp_path, Fake)
    write(tmp_path, "http://127.0.0.1:notaport")
    assert line.refresh() is False and line.client.url == "http://127.0.0.1:1"
    write(tmp_path, "http://127.0.0.1:3")
    assert line.refresh() is True and line.client.url == "http://127.0.0.1:3"


def test_a_forced_refresh_reads_the_file_whatever_its_stat_says(tmp_path: Path) -> None:
    write(tmp_path, "http://127.0.0.1:1")
    line = FollowedClient("http://127.0.0.1:1", "t", tmp_path, Fake)
    assert line.refresh() is False
    stat = (tmp_path / "controller.json").stat()
    write(tmp_path, "http://127.0.0.1:2")  # same size; the stat put back as a stale cache would show it
    import os
    os.utime(tmp_path / "controller.json", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    line._seen = ((tmp_path / "controller.json").stat().st_ino, stat.st_mtime_ns, stat.st_size)
    assert line.refresh() is False
    assert line.refresh(force=True) is True and line.client.url == "http://127.0.0.1:2"


def test_no_client_is_made_after_close(tmp_path: Path) -> None:
    write(tmp_path, "http://127.0.0.1:1")
    made: list[Fake] = []

    def connect(url: str, token: str) -> Fake:
        made.append(Fake(url, token))
        return made[-1]

    line = FollowedClient("http://127.0.0.1:1", "t", tmp_path, connect)
    line.close()
    write(tmp_path, "http://127.0.0.1:2")
    assert line.refresh() is False and len(made) == 1 and made[0].closed


def test_a_router_keeps_discovering_through_a_damaged_controller_json(tmp_path: Path) -> None:
    from slurm_elastic.router import Router

    silent = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    write(tmp_path, url)
    router = Router(url, "t", state_dir=tmp_path, poll_wait_s=3.0)
    try:
        time.sleep(0.3)
        write(tmp_path, "http://" + "a" * 70 + ":1")
        time.sleep(1.5)
        write(tmp_path, url)
        time.sleep(1.0)
        assert router._threads[0].is_alive()
    finally:
        router.close()
        silent.close()


def test_a_call_that_failed_on_a_client_another_thread_replaced_is_tried_on_the_new_one(tmp_path: Path) -> None:
    from typing import Any

    from slurm_elastic.errors import ControllerUnreachableError
    from slurm_elastic.worker.control import FollowingControl

    line: FollowingControl[Any]

    class Calls(Fake):
        def register(self, worker_id: str, info: dict[str, Any]) -> dict[str, Any]:
            return {}

        def heartbeat(self, worker_id: str, info: dict[str, Any]) -> dict[str, Any]:
            if self.url.endswith(":1"):
                line.refresh()  # the worker's other thread follows the move while this call waits
                raise ControllerUnreachableError("the old controller is gone")
            return {"ok": True}

    write(tmp_path, "http://127.0.0.1:1")
    line = FollowingControl("w1", "http://127.0.0.1:1", "t", tmp_path, Calls)
    assert line.refresh() is False
    write(tmp_path, "http://127.0.0.1:2")
    assert line.heartbeat({}) == {"ok": True}


def test_the_trainers_status_follows_a_moved_controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its status call was bound to the client in use when it began: after a move it called the
    closed one again and raised httpx's RuntimeError into the training loop."""
    import httpx

    import slurm_elastic.trainer as trainer_mod
    from slurm_elastic.client.control import ControlClient

    dead: set[int] = set()

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.port in dead:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path.endswith("/register"):
            return httpx.Response(200, json={"trainer_session": 1})
        return httpx.Response(200, json={"controller": {"workers": []}})

    monkeypatch.setattr(trainer_mod, "ControlClient",
                        lambda url, token: ControlClient(url, token, transport=httpx.MockTransport(answer)))
    write(tmp_path, "http://127.0.0.1:1001")
    trainer = trainer_mod.Trainer("http://127.0.0.1:1001", "t", tmp_path)
    assert trainer.status()["controller"] == {"workers": []}
    dead.add(1001)
    write(tmp_path, "http://127.0.0.1:1002")
    assert trainer.status()["controller"] == {"workers": []}
    trainer.close()


def test_a_routers_discovery_survives_a_malformed_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    import slurm_elastic.router as router_mod
    from slurm_elastic.client.control import ControlClient

    polls = {"n": 0}

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/endpoints":
            polls["n"] += 1
            if polls["n"] == 1:
                return httpx.Response(200, json=[])  # not the controller's answer: something else on its port
            return httpx.Response(200, json={"version": polls["n"], "endpoints": [
                {"worker_id": "w1", "url": "http://127.0.0.1:9/"}]})
        return httpx.Response(200, json={})

    monkeypatch.setattr(router_mod, "ControlClient",
                        lambda url, token: ControlClient(url, token, transport=httpx.MockTransport(answer)))
    router = router_mod.Router("http://127.0.0.1:1001", "t", poll_wait_s=0.1, report_interval_s=5)
    try:
        assert router.wait_for_endpoints(1, timeout_s=5.0) == {"w1": "http://127.0.0.1:9"}
    finally:
        router.close()
