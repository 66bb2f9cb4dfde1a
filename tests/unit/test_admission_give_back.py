"""A worker gives back what it was admitted and will not submit (a rollout that failed, a group
smaller than its admission), and a waiting admission is granted whole or not at all. Before, a
failed rollout's admission held the bound until ``admission_ttl_s`` (600 s by default: with
``max_staleness = 0`` training stopped that long), and workers that waited held parts of the
bound that none of them could use (a worker that admitted 4 and submitted 3 froze a run)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_elastic.client.control import ControlClient
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.worker import RolloutWorker
from slurm_elastic.worker.context import StepContext
from slurm_elastic.worker.control import FollowingControl
from tests.unit.served_controller import ServedController

TOKEN = "give-back-token"


def make(tmp: Path) -> RolloutQueue:
    config = QueueConfig(batch_size=8, capacity_seqs=100, max_staleness=0, max_concurrent=1000, fsync="off")
    return RolloutQueue(RolloutStore(tmp / "q.sqlite", fsync="off"), config, clock=lambda: 1000.0)


def test_a_give_back_frees_the_bound_at_once_once_per_id_and_across_a_restart(tmp_path: Path) -> None:
    q = make(tmp_path)
    assert q.admit(4, "0001", "a1") == 4 and q.admit(4, "0002", "a2") == 4 and q.admit(4, "0003") == 0
    assert q.give_back(4, "0001", "r1") == 4  # its rollout failed
    assert q.give_back(4, "0001", "r1") == 0  # the retry of that call: nothing again
    assert q.give_back(9, "0002", "r2") == 4  # at most what the lease holds
    assert q.give_back(1, "0009", "r3") == 0  # no lease: nothing
    q.store.close()
    again = make(tmp_path)
    assert again.give_back(4, "0002", "r2") == 0 and again.staleness.running == 0  # saved before the answer
    assert again.admit(8, "0003") == 8


def test_a_whole_admission_is_all_or_none_and_leaves_the_lease_as_it_was(tmp_path: Path) -> None:
    q = make(tmp_path)
    assert q.admit(5, "0001") == 5
    assert q.admit(4, "0002", "w1", whole=True) == 0 and q.staleness.running == 5  # 3 left: none taken
    assert q.admit(4, "0002", "w1", whole=True) == 0  # its retry: answered the same
    assert q.admit(3, "0002", "w2", whole=True) == 3
    assert q.admit(4, "0003") == 0 and q.staleness.running == 8


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedController]:
    server = ServedController(tmp_path, TOKEN, {"autoscaler": {"min_workers": 0}}, batch_size=8).launched(
        "0001", "0002", "0003")
    yield server
    server.close()


def worker(served: ServedController, worker_id: str, monkeypatch: pytest.MonkeyPatch) -> RolloutWorker:
    monkeypatch.setenv("SLURM_ELASTIC_WORKER_ID", worker_id)
    monkeypatch.setenv("SLURM_ELASTIC_CONTROLLER_URL", served.url)
    monkeypatch.setenv("SLURM_ELASTIC_TOKEN", TOKEN)
    ctx = StepContext.from_env()
    return RolloutWorker(ctx, FollowingControl(ctx.worker_id, ctx.controller_url, ctx.token, ctx.state_dir,
                                               connect=ControlClient))


def test_the_sdk_gives_back_a_failed_rollout_and_waits_for_whole_grants(
        served: ServedController, monkeypatch: pytest.MonkeyPatch) -> None:
    one, two = worker(served, "0001", monkeypatch), worker(served, "0002", monkeypatch)
    room = served.queue.staleness.capacity()  # (max_staleness + 1) batches
    assert one.admit(room - 7) == room - 7 and two.admit(4) == 4
    assert one.admit(4, wait=False) == 3  # without waiting: what the bound allows now
    assert served.queue.staleness.running == room
    assert two.admit(4, wait=False) == 0
    assert one.give_back(5) == 5  # its rollouts failed: the room goes to the others now
    assert two.admit(5, wait=True, poll_s=0.01) == 5 and served.queue.staleness.running == room
    with ControlClient(served.url, TOKEN) as client:
        answer = client.admit(1, "0003", "x", whole=True)
        assert answer["granted"] == 0 and answer["staleness_capacity"] == 0
        bad = client._http.post("/rollouts/admission/release", json={"sequences": 0, "worker_id": "0001"})
    assert bad.status_code == 422 and "release_id" in bad.text and "sequences" in bad.text
    one.close(), two.close()


def test_the_sdk_asks_again_while_a_restarted_controller_does_not_know_it_yet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A controller restarted without its saved state knows no worker until it lists the job's
    steps: the admission's 404 is asked again, and granted once the worker is known; an id that
    stays unknown gets the error after UNKNOWN_WAIT_S."""
    import threading

    import slurm_elastic.worker as sdk
    from slurm_elastic.errors import UnknownOnControllerError

    server = ServedController(tmp_path, TOKEN, {"autoscaler": {"min_workers": 0}}, batch_size=8)
    try:
        monkeypatch.setattr(sdk, "UNKNOWN_WAIT_S", 1.0)
        with pytest.raises(UnknownOnControllerError, match="worker 0005 was not launched"):
            worker(server, "0005", monkeypatch).admit(4)
        monkeypatch.setattr(sdk, "UNKNOWN_WAIT_S", 30.0)
        threading.Timer(0.5, lambda: server.launched("0004")).start()  # its first listing
        assert worker(server, "0004", monkeypatch).admit(4) == 4
        assert server.queue.staleness.running == 4
    finally:
        server.close()
