"""The staleness counts of the rollout queue over the real store, through controller restarts:
each case is one way the counts used to drift from AReaL's (issue: admission and recovery)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_elastic.core.staleness import VersionRefused
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


CLOCK = Clock()


def make(tmp: Path, **cfg: object) -> RolloutQueue:
    config = QueueConfig(**{"batch_size": 8, "capacity_seqs": 1000, "max_staleness": 1, "max_concurrent": 1000,
                            "admission_ttl_s": 60, "fsync": "off", **cfg})  # type: ignore[arg-type]
    return RolloutQueue(RolloutStore(tmp / "q.sqlite", fsync="off"), config, clock=CLOCK)


def restart(q: RolloutQueue, tmp: Path) -> RolloutQueue:
    q.store.close()
    return make(tmp)


def submit(q: RolloutQueue, group_id: str, worker_id: str = "0001", n: int = 4, version: int = 0) -> None:
    body = json.dumps({"id": group_id, "group_size": n, "policy_version": version,
                       "sequences": [{"tokens": [1], "score": 1.0}] * n}).encode()
    assert q.submit(group_id, worker_id, n, version, body)


def capacity(q: RolloutQueue) -> tuple[int, int]:
    stats = q.stats()
    return stats["staleness_capacity"], stats["running_rollouts"]


def test_a_restart_counts_groups_queued_and_handed_out(tmp_path: Path) -> None:
    q = make(tmp_path)
    assert q.admit(16, "0001") == 16  # one window: (1 + 0 + 1) * 8
    for i in range(4):
        submit(q, f"g{i}")
    assert q.pull() is not None  # 8 handed out, not acknowledged; 8 queued
    assert capacity(q) == (0, 0)
    q = restart(q, tmp_path)
    assert capacity(q) == (0, 0)  # was 16: the reloaded groups were forgotten


def test_admissions_in_flight_survive_a_restart(tmp_path: Path) -> None:
    q = make(tmp_path)
    assert q.admit(10, "0001") == 10
    submit(q, "a", "0001", 4)  # 6 still admitted and running
    q = restart(q, tmp_path)
    assert capacity(q) == (16 - 4 - 6, 6)
    submit(q, "b", "0001", 4)  # the restored lease is used, not taken twice
    assert capacity(q) == (16 - 8 - 2, 2)
    CLOCK.t += 61  # the worker died with 2 admitted: released after the ttl, on a restart too
    q = restart(q, tmp_path)
    assert capacity(q) == (8, 0)


def test_a_dead_workers_lease_is_not_moved_onto_a_live_one(tmp_path: Path) -> None:
    q = make(tmp_path)
    assert q.admit(4, "0001") == 4  # worker 1 dies mid-rollout
    CLOCK.t += 30
    assert q.admit(4, "0002") == 4
    submit(q, "b", "0002")  # uses worker 2's lease, not worker 1's older one
    CLOCK.t += 31  # worker 1's lease is past the ttl; nothing else is open
    assert capacity(q) == (16 - 4, 0)


@pytest.mark.parametrize("late", [True, False])
def test_late_or_unadmitted_results_do_not_take_from_running_twice(tmp_path: Path, late: bool) -> None:
    q = make(tmp_path)
    if late:
        assert q.admit(4, "0002") == 4
        CLOCK.t += 61  # worker 2's lease expires before its result arrives
    assert q.admit(4, "0001") == 4
    submit(q, "x", "0002")  # late, or never admitted: worker 1's rollouts are still running
    assert capacity(q) == (16 - 4 - 4, 4)


def test_expiry_runs_without_an_admission(tmp_path: Path) -> None:
    q = make(tmp_path)
    q.admit(16, "0001")
    CLOCK.t += 61
    assert capacity(q) == (16, 0)  # status and the autoscaler read the current capacity
    q.admit(16, "0001")
    CLOCK.t += 61
    q.expire_admissions()  # the controller's tick
    assert q.leases.leases == {} and q.staleness.running == 0


def test_plain_publishes_may_not_go_back_or_jump(tmp_path: Path) -> None:
    q = make(tmp_path)
    q.set_version(2)
    submit(q, "a", version=2)
    with pytest.raises(VersionRefused, match="recovered=true"):
        q.set_version(1)
    with pytest.raises(VersionRefused, match="recovered=true"):
        q.set_version(10**6)  # a typo: used to drop every queued group (10**30: outside what the store holds)
    with pytest.raises(VersionRefused, match="outside"):
        q.set_version(10**30)
    q.set_version(2)  # the same version again (a retry) is fine
    assert q.pull() is None and q.stats()["dropped_stale_sequences"] == 0
    q.set_version(4)  # max_staleness + 1 past: allowed
    assert q.stats()["policy_version"] == 4


def test_a_recovered_trainer_finds_the_buffer_counted(tmp_path: Path) -> None:
    q = make(tmp_path)
    q.admit(16, "0001")
    for i in range(4):
        submit(q, f"g{i}")
    q.set_version(40, recovered=True)  # the trainer resumed at 40; 16 sequences still wait for it
    assert capacity(q) == (0, 0)
    q = restart(q, tmp_path)
    assert capacity(q) == (0, 0) and q.stats()["policy_version"] == 40
    q.set_version(41)
    assert capacity(q) == (8, 0)


def test_a_store_with_a_version_and_no_staleness_counts_is_refused(tmp_path: Path) -> None:
    from slurm_elastic.errors import StateFileError

    q = make(tmp_path)
    submit(q, "a")
    q.store.set_meta("version", "7")  # a format that kept only the version
    q.store.close()
    with pytest.raises(StateFileError, match="without the staleness counts"):
        make(tmp_path)


def app_over(q: RolloutQueue, tmp: Path):  # type: ignore[no-untyped-def]
    from slurm_elastic.controller.app import create_controller_app
    from slurm_elastic.controller.config import parse_config
    from slurm_elastic.controller.runtime import Controller
    from slurm_elastic.slurm.cli_backend import SlurmCli

    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    controller = Controller(config, 1, SlurmCli(timeout_s=5), tmp, gpus_by_node={"node1": (0,)}, queue=q)
    controller.state.listed_worker_ids = frozenset(f"{i:04d}" for i in range(1, 10))  # as if their steps ran
    return create_controller_app(controller, "t", q)


def test_the_routes_lease_per_worker_and_refuse_bad_versions(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    q = make(tmp_path)
    client = TestClient(app_over(q, tmp_path), headers={"Authorization": "Bearer t"})
    missing = client.post("/rollouts/admission", json={"sequences": 4})
    assert missing.status_code == 422 and "worker_id" in missing.text
    answer = client.post("/rollouts/admission", json={"sequences": 4, "worker_id": "0007"}).json()
    assert answer["granted"] == 4 and q.leases.leases["0007"].unused_seqs == 4
    phantom = client.post("/rollouts/admission", json={"sequences": 4, "worker_id": "9999"})
    assert phantom.status_code == 404 and "worker 9999 was not launched by this controller" in phantom.text
    assert "9999" not in q.leases.leases and q.stats()["running_rollouts"] == 4  # it held the room for 600 s before
    assert client.post("/trainer/version", json={"version": 2}).status_code == 200
    lower = client.post("/trainer/version", json={"version": 1})
    assert lower.status_code == 409 and "recovered=true" in lower.json()["detail"]
    jump = client.post("/trainer/version", json={"version": 10**6})
    assert jump.status_code == 409 and "max_staleness + 1" in jump.json()["detail"]
    huge = client.post("/trainer/version", json={"version": 10**30, "recovered": True})
    assert huge.status_code == 422 and "version" in huge.text
    back = client.post("/trainer/version", json={"version": 1, "recovered": True})
    assert back.status_code == 200 and back.json()["policy_version"] == 1
    q.store.close()


@given(versions=st.lists(st.integers(0, 6), min_size=1, max_size=12), trainer_version=st.integers(0, 6),
       max_staleness=st.integers(0, 3))
@settings(max_examples=40, deadline=None)
def test_the_simulator_drops_by_the_queues_rule(versions: list[int], trainer_version: int,
                                                max_staleness: int) -> None:
    """One drop rule (core.staleness.is_untrainable: stale, or made past a version the trainer
    went back to): the simulator's buffer and the real queue drop the same groups."""
    import dataclasses
    import tempfile

    from slurm_elastic.sim.engine import Simulation
    from tests.unit.test_simulate import short

    trace = short()
    sim = Simulation(dataclasses.replace(trace, queue=dataclasses.replace(
        trace.queue, max_staleness=max_staleness, capacity_seqs=1000)))
    with tempfile.TemporaryDirectory() as tmp:
        q = make(Path(tmp), max_staleness=max_staleness, batch_size=1000)
        for i, version in enumerate(versions):
            q.set_version(version, recovered=True)  # made while the trainer was there
            submit(q, f"g{i}", n=2, version=version)
            sim.buffer.append((version, 2))
            sim.queued_seqs += 2
        q.set_version(trainer_version, recovered=True)
        sim.version = trainer_version
        assert q.pull() is None
        assert sim._drop_untrainable() == q.stats()["dropped_stale_sequences"]
        assert sim.queued_seqs == q.stats()["queued_sequences"]
        q.store.close()


def test_concurrent_admissions_share_writes_and_all_survive_a_restart(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    q = make(tmp_path, max_staleness=100)
    with ThreadPoolExecutor(16) as pool:
        granted = sum(pool.map(lambda i: q.admit(1, f"{i % 8:04d}"), range(200)))
    assert granted == 200 and q.staleness.running == 200
    q = restart(q, tmp_path)
    assert q.staleness.running == 200 and sum(held.unused_seqs for held in q.leases.leases.values()) == 200


def test_an_admission_that_cannot_be_recorded_is_taken_back(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    q = make(tmp_path)
    q.admit(4, "0001")

    def full_disk(key: str, value: str, transition: bool = False) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(q.store, "set_meta", full_disk)
    with pytest.raises(OSError):
        q.admit(4, "0002")
    assert q.staleness.running == 4 and "0002" not in q.leases.leases
    monkeypatch.undo()
    q = restart(q, tmp_path)
    assert q.staleness.running == 4


def test_the_worker_sdk_asks_for_its_own_lease_and_its_submit_uses_it(tmp_path: Path) -> None:
    from slurm_elastic.controller.serve import ApiServer
    from slurm_elastic.worker import RolloutWorker, StepContext

    q = make(tmp_path)
    server = ApiServer(app_over(q, tmp_path), "127.0.0.1")
    server.start()
    try:
        ctx = StepContext(worker_id="0007", controller_url=server.url, token="t", heartbeat_interval_s=60,
                          drain_signal="USR1", node="node1", gpus=(0,), step_id="3", job_id="1")
        worker = RolloutWorker(ctx)
        assert worker.admit(4) == 4 and q.leases.leases["0007"].unused_seqs == 4
        worker.submit({"id": "sdk-1", "policy_version": 0, "group_size": 4,
                       "sequences": [{"tokens": [1, 2], "score": 1.0}] * 4})
        assert q.leases.leases["0007"].unused_seqs == 0 and capacity(q) == (16 - 4, 0)
        worker.close()
    finally:
        server.stop()
        q.store.close()


def test_a_damaged_snapshot_stops_the_queue_with_a_clear_error(tmp_path: Path) -> None:
    from slurm_elastic.errors import StateFileError

    q = make(tmp_path)
    q.store.set_meta("staleness", '{"version": "x"}')
    q.store.close()
    with pytest.raises(StateFileError, match="staleness snapshot"):
        make(tmp_path)


def test_the_controller_reads_the_queue_it_was_built_with_and_the_routes_serve_that_one(tmp_path: Path) -> None:
    from slurm_elastic.controller.app import create_controller_app
    from slurm_elastic.controller.config import parse_config
    from slurm_elastic.controller.runtime import Controller
    from slurm_elastic.slurm.cli_backend import SlurmCli

    q = make(tmp_path)
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    controller = Controller(config, 1, SlurmCli(timeout_s=5), tmp_path, gpus_by_node={"node1": (0,)}, queue=q)
    assert controller.pressure_inputs(4, CLOCK()).queued_seqs is None  # not in use yet
    submit(q, "g1", n=4)
    seen = controller.pressure_inputs(4, CLOCK())
    assert (seen.queued_seqs, seen.batch_size, seen.buffer_capacity_seqs) == (4, 8, 1000)
    assert controller.status()["queue"]["queued_sequences"] == 4
    (tmp_path / "other").mkdir()
    other = make(tmp_path / "other")
    with pytest.raises(ValueError, match="another queue"):
        create_controller_app(controller, "t", other)
    q.store.close()
    other.store.close()
