"""Weights follow the trainer, through the real HTTP server: the trainer publishes a version with
its weights, the controller keeps it durably and pushes it to every server (fake SGLang and vLLM
engines with their documented update endpoints, on real sockets), a failing or hung server leaves
discovery and is drained for replacement, a new server enters discovery only at the latest weights."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slurm_elastic.client.control import ControlClient
from slurm_elastic.controller.app import create_controller_app
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.controller.serve import ApiServer
from slurm_elastic.controller.weights import WeightsPusher
from slurm_elastic.core.lifecycle import Worker, WorkerState
from slurm_elastic.errors import ApiError
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.router import Router
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.status_view import render_status
from slurm_elastic.trainer import Trainer
from tests.fake_engines import FakeEngine, make_server

TOKEN = "weights-token"
WAIT_S = 20.0  # the longest any condition below is waited for (never reached when all is well)


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout_s:g} s: {what}")


class Engines:
    """Fake engines served on real sockets."""

    def __init__(self) -> None:
        self.servers: list[Any] = []

    def start(self, engine: FakeEngine) -> str:
        server = make_server(engine)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.servers.append((server, engine))
        return f"http://127.0.0.1:{server.server_address[1]}"

    def close(self) -> None:
        for server, engine in self.servers:
            engine.release.set()
            server.shutdown()
            server.server_close()


class Job:
    """A server job's controller (no Slurm ticks: workers are recorded as launched) behind the real
    API server, with its weights pusher running."""

    def __init__(self, state: Path, weights: dict[str, Any]) -> None:
        config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0},
                               "workers": {"kind": "server", "command": ["engine", "{port}"]}, "weights": weights})
        self.state = state
        self.queue = RolloutQueue(RolloutStore(state / "q.sqlite", fsync="off"), QueueConfig(batch_size=8))
        self.controller = Controller(config, 1, SlurmCli(timeout_s=5), state, gpus_by_node={"node1": (0, 1, 2, 3)},
                                     queue=self.queue)
        self.pusher = WeightsPusher(self.controller).start()
        self.server = ApiServer(create_controller_app(self.controller, TOKEN, self.queue), "127.0.0.1")
        self.server.start()
        self.client = ControlClient(self.server.url, TOKEN)
        self.trainer = Trainer(self.server.url, TOKEN)
        self.closed = False

    def add_server(self, worker_id: str, url: str, weights_version: int | None = None) -> dict[str, Any]:
        """A launched server step registers, then reports ready at ``url``: the wrapper's two calls."""
        with self.controller.lock:
            self.controller.workers[worker_id] = Worker(worker_id, launched_at_s=time.time())
        first = self.client.register(worker_id, {"node": "node1", "gpus": [0], "step_id": "1", "ready": False})
        ready = {"node": "node1", "gpus": [0], "step_id": "1", "ready": True, "endpoint": url}
        if weights_version is not None:
            ready["weights_version"] = weights_version
        self.client.register(worker_id, ready)
        return first

    def routable(self) -> set[str]:
        return {e["worker_id"] for e in self.client.endpoints()["endpoints"]}

    def worker(self, worker_id: str) -> dict[str, Any]:
        return next(w for w in self.client.status()["workers"] if w["worker_id"] == worker_id)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.trainer.close()
        self.client.close()
        self.pusher.stop()
        self.server.stop()
        self.queue.store.close()


@pytest.fixture
def engines() -> Iterator[Engines]:
    e = Engines()
    yield e
    e.close()


@pytest.fixture
def job_factory(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def make(**weights: Any) -> Job:
        job = Job(tmp_path, {"update": "sglang", "timeout_s": 5.0, "retry_backoff_s": 0.05, **weights})
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()


@pytest.mark.parametrize("preset", ["sglang", "vllm"])
def test_a_publish_reaches_every_server_within_the_timeout(preset: str, engines: Engines,
                                                           job_factory: Callable[..., Job]) -> None:
    job = job_factory(update=preset)
    fakes = [FakeEngine(preset, worker_id=f"000{i}", model="/models/base") for i in range(1, 4)]
    for i, fake in enumerate(fakes, 1):
        job.add_server(f"000{i}", engines.start(fake))
    assert job.routable() == {"0001", "0002", "0003"}  # nothing published yet: base weights serve
    published_at = time.monotonic()
    answer = job.trainer.publish_version(1, weights="/ckpt/step-1")
    assert answer["weights"] == {"version": 1, "ref": "/ckpt/step-1"}
    wait_for(lambda: all(f.weights_path == "/ckpt/step-1" for f in fakes), "every engine loaded /ckpt/step-1")
    wait_for(lambda: all(job.worker(w)["weights_version"] == 1 for w in ("0001", "0002", "0003")),
             "every server recorded at version 1")
    assert time.monotonic() - published_at < 5.0  # weights.timeout_s
    expected = ({"path": "/ckpt/step-1", "version": "1"} if preset == "sglang"
                else {"path": "/ckpt/step-1", "version": None})  # SGLang's weight_version; vLLM has none
    assert all(f.updates == [expected] for f in fakes)
    view = job.client.endpoints()
    assert view["weights_version"] == 1 and {e["weights_version"] for e in view["endpoints"]} == {1}
    text = render_status(1, job.client.status())
    assert "weights: version 1 (/ckpt/step-1)  servers at it: 3/3" in text and "WEIGHTS" in text


def test_a_version_published_again_with_other_weights_is_refused_and_changes_nothing(
        engines: Engines, job_factory: Callable[..., Job]) -> None:
    job = job_factory()
    fake = FakeEngine("sglang", worker_id="0001")
    job.add_server("0001", engines.start(fake))
    job.trainer.publish_version(1, weights="/ckpt/1")
    wait_for(lambda: fake.weights_path == "/ckpt/1", "the engine loaded /ckpt/1")
    with pytest.raises(ApiError) as refused:
        job.trainer.publish_version(1, weights="/ckpt/1-fixed")
    assert refused.value.status_code == 409 and "other weights need a new version" in str(refused.value)
    assert job.trainer.publish_version(1, weights="/ckpt/1")["weights"]["ref"] == "/ckpt/1"  # a retry: as it was
    assert job.client.status()["weights"]["ref"] == "/ckpt/1" and len(fake.updates) == 1
    job.trainer.publish_version(2, weights="/ckpt/1-fixed")  # a new version: pushed
    wait_for(lambda: fake.weights_path == "/ckpt/1-fixed", "the engine loaded /ckpt/1-fixed")


def test_a_failing_server_leaves_discovery_at_once_is_retried_then_drained_for_replacement(
        engines: Engines, job_factory: Callable[..., Job]) -> None:
    job = job_factory(max_failures=3)
    good = FakeEngine("sglang", worker_id="0001")
    bad = FakeEngine("sglang", update="fail", worker_id="0002")
    job.add_server("0001", engines.start(good))
    job.add_server("0002", engines.start(bad))
    job.trainer.publish_version(1, weights="/ckpt/1")
    wait_for(lambda: job.routable() == {"0001"} or None, "the failing server out of discovery")
    wait_for(lambda: job.worker("0002")["state"] == "DRAINING", "the failing server drained")
    assert len(bad.updates) == 3 and good.weights_path == "/ckpt/1"  # tried max_failures times
    record = job.controller.workers["0002"]
    reason = record.history[-1][3]
    assert reason.startswith("weights update to version 1 failed 3 times in a row: HTTP 400")
    assert "safetensors header is corrupt" in reason
    assert not record.counts_as_capacity  # the target launches a replacement, as for any drained worker
    assert job.routable() == {"0001"} and job.worker("0001")["weights_version"] == 1


def test_a_hung_update_times_out_and_the_others_are_not_held_up(engines: Engines,
                                                                job_factory: Callable[..., Job]) -> None:
    job = job_factory(update="vllm", timeout_s=0.5, max_failures=1)
    hung = FakeEngine("vllm", update="hang", worker_id="0001")
    ok = [FakeEngine("vllm", worker_id=f"000{i}") for i in (2, 3)]
    job.add_server("0001", engines.start(hung))
    for i, fake in zip((2, 3), ok, strict=True):
        job.add_server(f"000{i}", engines.start(fake))
    job.trainer.publish_version(1, weights="/ckpt/1")
    wait_for(lambda: all(f.weights_path == "/ckpt/1" for f in ok), "the other servers updated")
    wait_for(lambda: job.worker("0001")["state"] == "DRAINING", "the hung server drained")
    assert job.controller.workers["0001"].history[-1][3].endswith("no answer within 0.5 s")
    assert job.routable() == {"0002", "0003"}


def test_a_new_server_enters_discovery_only_once_it_runs_the_latest_weights(
        engines: Engines, job_factory: Callable[..., Job]) -> None:
    job = job_factory()
    job.trainer.publish_version(1, weights="/ckpt/1")
    job.trainer.publish_version(2, weights="/ckpt/2")
    fake = FakeEngine("sglang", worker_id="0001", model="/models/base")
    first = job.add_server("0001", engines.start(fake))
    assert first["weights"] == {"version": 2, "ref": "/ckpt/2"}  # the registration answer tells it
    seen: list[tuple[set[str], str]] = []
    with Router(job.server.url, TOKEN, poll_wait_s=1.0) as router:
        router.wait_for_endpoints(1, timeout_s=WAIT_S)
        reply = router.request("POST", "/generate", json={"id": 1})
        seen.append((set(router.endpoints()), reply.json()["weights_path"]))
        assert reply.extensions["weights_version"] == 2  # what a submit records as its policy_version
    assert seen == [({"0001"}, "/ckpt/2")] and fake.updates == [{"path": "/ckpt/2", "version": "2"}]
    # a server whose command started it on the latest weights is in discovery at once, no update sent
    started_on_latest = FakeEngine("sglang", worker_id="0002", model="/ckpt/2")
    job.add_server("0002", engines.start(started_on_latest), weights_version=2)
    assert "0002" in job.routable() and started_on_latest.updates == []


def test_routers_can_ask_for_servers_at_the_latest_weights_only(engines: Engines,
                                                                 job_factory: Callable[..., Job]) -> None:
    job = job_factory(retry_backoff_s=60.0)
    job.add_server("0001", engines.start(FakeEngine("sglang", worker_id="0001")))
    job.add_server("0002", engines.start(FakeEngine("sglang", update="hang", worker_id="0002")))
    job.trainer.publish_version(1, weights="/ckpt/1")
    wait_for(lambda: job.worker("0001")["weights_version"] == 1, "0001 updated")
    # 0002 joined before the publish and is still updating: routable, but not at the latest weights
    assert job.routable() == {"0001", "0002"}
    latest = job.client.endpoints(latest_weights_only=True)
    assert [e["worker_id"] for e in latest["endpoints"]] == ["0001"]
    with Router(job.server.url, TOKEN, poll_wait_s=1.0, latest_weights_only=True) as router:
        router.wait_for_endpoints(1, timeout_s=WAIT_S)
        assert set(router.endpoints()) == {"0001"}
        assert all(router.request("POST", "/generate", json={"id": i}).json()["worker"] == "0001" for i in range(5))


def test_a_request_at_the_latest_weights_only_waits_out_the_update_instead_of_failing(
        engines: Engines, job_factory: Callable[..., Job]) -> None:
    """Before, a latest-only router had no server while a publish was pushed, and every request
    sent then failed at once with "no routable server"."""
    job = job_factory()
    engine = FakeEngine("sglang", update="hang", worker_id="0001")
    job.add_server("0001", engines.start(engine))
    job.trainer.publish_version(1, weights="/ckpt/1")
    with Router(job.server.url, TOKEN, poll_wait_s=1.0, latest_weights_only=True) as router:
        replies: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: replies.append(router.request("POST", "/generate", json={"id": 1})))
        sender.start()
        time.sleep(0.3)
        assert sender.is_alive() and router.endpoints() == {}, "it waits while no server is at the latest weights"
        engine.update = "ok"
        engine.release.set()  # the hung update fails; the next one loads
        sender.join(WAIT_S)
    assert replies[0].json() == {"worker": "0001", "id": 1, "weights_path": "/ckpt/1"}
    assert replies[0].extensions["weights_version"] == 1


def test_the_trainer_can_wait_until_a_server_runs_its_weights_or_learn_why_none_does(
        engines: Engines, job_factory: Callable[..., Job]) -> None:
    """A publish is answered once kept, before any server loaded it; before, a trainer whose
    weights no server could load heard 200 and nothing more."""
    from slurm_elastic.trainer import WeightsNotLoadedError

    job = job_factory(max_failures=2)
    engine = FakeEngine("sglang", update="fail", worker_id="0001")
    job.add_server("0001", engines.start(engine))
    job.trainer.publish_version(1, weights="/ckpt/1")  # a checkpoint no server can load
    with pytest.raises(WeightsNotLoadedError, match=r"0 of 1 active servers run weights version 1 after 1 s \(1 "
                                                    r"wanted\): 0001: .*safetensors header is corrupt"):
        job.trainer.wait_for_weights(1, timeout_s=1.0, poll_s=0.05)
    engine.update = "ok"
    job.trainer.publish_version(2, weights="/ckpt/2")
    assert job.trainer.wait_for_weights(2, timeout_s=WAIT_S, poll_s=0.05) == 1


def test_the_latest_weights_survive_a_controller_restart_and_bad_weights_get_a_clear_422(
        engines: Engines, job_factory: Callable[..., Job]) -> None:
    job = job_factory()
    job.trainer.publish_version(4, weights="/ckpt/4")
    for bad, why in [("", "at least 1 character"), ("/ckpt/\n5", "printable"), ("x" * 5000, "at most 4096")]:
        with pytest.raises(ApiError) as refused:
            job.client.set_version(5, weights=bad)
        assert refused.value.status_code == 422 and why in str(refused.value), str(refused.value)
    with httpx.Client(base_url=job.server.url, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        assert http.post("/trainer/version", json={"version": 5, "weights": 7}).status_code == 422
    assert job.client.status()["weights"]["version"] == 4  # nothing refused was kept
    job.close()
    again = job_factory()
    assert again.client.status()["weights"] == {"version": 4, "ref": "/ckpt/4", "enforced": True}
    fake = FakeEngine("sglang", worker_id="0001")
    assert again.add_server("0001", engines.start(fake))["weights"] == {"version": 4, "ref": "/ckpt/4"}
    wait_for(lambda: fake.weights_path == "/ckpt/4", "the restarted controller pushed the kept weights")


def test_a_server_on_its_own_weights_stays_in_discovery_across_a_restart_during_the_first_publish(
        engines: Engines, job_factory: Callable[..., Job]) -> None:
    job = job_factory(timeout_s=30.0)  # the update hangs past the restart, however slow this machine is
    slow = FakeEngine("sglang", update="hang", worker_id="0001")
    job.add_server("0001", engines.start(slow))  # before any publish: in discovery on the weights it started with
    assert job.routable() == {"0001"}
    job.trainer.publish_version(1, weights="/ckpt/1")
    wait_for(lambda: job.worker("0001")["weights_updating_to"] == 1, "the first publish is being pushed")
    job.controller.save()
    job.close()
    again = job_factory(timeout_s=0.5)  # the restarted controller: the update to 1 is still due
    with again.controller.lock:
        again.controller.publish_endpoints()  # as its first tick does
    assert again.routable() == {"0001"}, "a server in discovery before the restart stays in while its update runs"
    slow.update = "ok"
    wait_for(lambda: again.worker("0001")["weights_version"] == 1, "the kept weights reached the server")
    assert again.routable() == {"0001"}


def test_the_weights_the_fleet_runs_are_kept_across_a_restart_while_the_latest_are_not_loaded(
        engines: Engines, job_factory: Callable[..., Job]) -> None:
    """A server relaunched after a publish no server loads is given the fleet's weights: a
    restarted controller must still know them."""
    from slurm_elastic.core.weights import PublishedWeights

    job = job_factory()
    engine = FakeEngine("sglang", worker_id="0001")
    job.add_server("0001", engines.start(engine))
    job.trainer.publish_version(1, weights="/ckpt/1")
    assert job.trainer.wait_for_weights(1, timeout_s=WAIT_S, poll_s=0.05) == 1
    engine.update = "fail"
    job.trainer.publish_version(2, weights="/ckpt/bad")
    job.close()
    again = job_factory()
    assert (again.controller.weights.latest, again.controller.weights.fallback) == (
        PublishedWeights(2, "/ckpt/bad"), PublishedWeights(1, "/ckpt/1"))


def test_the_record_drops_the_fleets_weights_once_a_server_loads_the_latest(
        engines: Engines, job_factory: Callable[..., Job]) -> None:
    import json

    job = job_factory()
    job.add_server("0001", engines.start(FakeEngine("sglang", worker_id="0001")))
    for version in (1, 2):
        job.trainer.publish_version(version, weights=f"/ckpt/{version}")
        assert job.trainer.wait_for_weights(version, timeout_s=WAIT_S, poll_s=0.05) == 1
    wait_for(lambda: "fallback" not in json.loads((job.state / "weights.json").read_text()),
             "the record written again without the fallback")


def test_a_publish_refused_by_the_staleness_rules_records_no_weights(job_factory: Callable[..., Job]) -> None:
    job = job_factory()
    job.trainer.publish_version(3, weights="/ckpt/3")
    with pytest.raises(ApiError) as refused:
        job.client.set_version(2, weights="/ckpt/2")  # lower than the current version
    assert refused.value.status_code == 409
    assert job.client.status()["weights"]["version"] == 3
    assert WorkerState.ACTIVE.value == "ACTIVE"


def test_the_weights_table_is_checked_when_loaded_and_the_example_server_job_is_valid() -> None:
    from slurm_elastic.controller.config import load_config
    from slurm_elastic.errors import ConfigError

    for table, why in [({"update": "http"}, "needs a path starting with /"),
                       ({"update": "command"}, "needs a command"),
                       ({"update": "sglang", "path": "/x"}, "is a preset"),
                       ({"update": "reload"}, "weights.update"),
                       ({"timeout_s": 0}, "weights.timeout_s")]:
        with pytest.raises(ConfigError, match=why):
            parse_config({"weights": table})
    example = load_config(Path(__file__).resolve().parents[2] / "examples" / "server.toml")
    assert example.workers.kind == "server" and example.weights.update == "sglang"


def test_an_http_template_and_a_command_hook_fill_their_placeholders(tmp_path: Path, engines: Engines) -> None:
    from slurm_elastic.controller.weights import UpdateHook
    from slurm_elastic.core.weights import PublishedWeights, UpdateOrder

    fake = FakeEngine("sglang", worker_id="0001")
    url = engines.start(fake)
    order = UpdateOrder("0001", url, PublishedWeights(9, "/ckpt/{x}/9"), 1)
    http = UpdateHook(parse_config({"workers": {"kind": "server"}, "weights": {"update": "http", "path": "/update_weights_from_disk",
                                                "body": {"model_path": "{path}", "weight_version": "v{version}"}}}).weights)
    assert http(order) == "" and fake.updates == [{"path": "/ckpt/{x}/9", "version": "v9"}]
    out = tmp_path / "hook.out"
    command = UpdateHook(parse_config({"workers": {"kind": "server"}, "weights": {"update": "command", "command": [
        "sh", "-c", f"echo {{worker_id}} {{url}} {{version}} {{path}} > {out}"]}}).weights)
    assert command(order) == "" and out.read_text().split() == ["0001", url, "9", "/ckpt/{x}/9"]
    failing = UpdateHook(parse_config({"workers": {"kind": "server"}, "weights": {"update": "command", "command": ["false"]}}).weights)
    assert "false" in failing(order)
    for hook in (http, command, failing):
        hook.close()


def test_a_restart_in_the_middle_of_a_publish_sends_the_update_once_to_a_server_that_loaded_it(
        engines: Engines, job_factory: Callable[..., Job]) -> None:
    """A controller restarted while its updates were in flight sent them all again at once: a server
    loading the weights (minutes, for a large model) got a second load. Now the updates in flight
    are saved before they are sent; the restarted controller sends nothing until their time limit
    has passed, then asks an SGLang server its version and sends the update only to one that does
    not run it (the update is not lost)."""
    job = job_factory(timeout_s=3.0)
    loaded, lost = (FakeEngine("sglang", update="hang", worker_id=w) for w in ("0001", "0002"))
    job.add_server("0001", engines.start(loaded))
    job.add_server("0002", engines.start(lost))
    job.trainer.publish_version(1, weights="/ckpt/1")
    wait_for(lambda: len(loaded.updates) == len(lost.updates) == 1, "both updates sent")
    job.close()  # the controller dies with both updates in flight; nothing records their outcome
    loaded.weights_path, loaded.weight_version = "/ckpt/1", "1"  # this one finished loading meanwhile
    loaded.update = lost.update = "ok"
    again = job_factory(timeout_s=3.0)
    assert again.worker("0001")["weights_updating_to"] == 1  # adopted: shown as under way
    time.sleep(0.5)
    assert len(loaded.updates) == len(lost.updates) == 1, "nothing sent while the updates may still be loading"
    wait_for(lambda: again.worker("0001")["weights_version"] == again.worker("0002")["weights_version"] == 1,
             "both servers at version 1")
    assert len(loaded.updates) == 1, "the server that loaded it was asked its version, not sent it again"
    assert len(lost.updates) == 2 and lost.weights_path == "/ckpt/1", "the one that had not got it did"
    assert again.routable() == {"0001", "0002"}


def test_a_server_that_keeps_failing_its_update_is_replaced_whatever_restarts_come_between(
        engines: Engines, job_factory: Callable[..., Job]) -> None:
    """Its failures in a row started from 0 again at each restart of the controller: a server that
    keeps failing was never replaced. They are saved with the state now."""
    job = job_factory(max_failures=3, retry_backoff_s=1.0)
    job.add_server("0001", engines.start(FakeEngine("sglang", worker_id="0001")))
    bad = FakeEngine("sglang", update="fail", worker_id="0002")
    job.add_server("0002", engines.start(bad))
    job.trainer.publish_version(1, weights="/ckpt/1")
    wait_for(lambda: job.worker("0002")["weights_update_failures"] == 2, "two failures in a row")
    job.close()
    again = job_factory(max_failures=3, retry_backoff_s=1.0)
    assert again.worker("0002")["weights_update_failures"] == 2
    wait_for(lambda: again.worker("0002")["state"] == "DRAINING", "the failing server drained")
    assert len(bad.updates) == 3
    assert again.controller.workers["0002"].history[-1][3].startswith("weights update to version 1 failed 3 times")
