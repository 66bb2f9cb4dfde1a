"""The controller end to end on the dev cluster: real allocation, real worker steps, real signals."""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.devcluster.cluster import DevCluster
from tests.cluster.controller_harness import (
    ControllerJob,
    start_controller_job,
    stop_controller_job,
    wait_for,
)

pytestmark = pytest.mark.cluster


def starts_by_worker(job: ControllerJob) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in job.events():
        if e["event"] == "start":
            out[e["worker"]].append(e)
    return out


def unfinished_rollouts(job: ControllerJob) -> dict[str, set[int]]:
    begun: dict[str, set[int]] = defaultdict(set)
    ended: dict[str, set[int]] = defaultdict(set)
    for e in job.events():
        if e["event"] == "rollout_begin":
            begun[e["worker"]].add(e["n"])
        elif e["event"] == "rollout_end":
            ended[e["worker"]].add(e["n"])
    return {w: begun[w] - ended[w] for w in begun if begun[w] - ended[w]}


@pytest.fixture(scope="class")
def shared_job(devcluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControllerJob]:
    """One controller job (default options) for the independent checks of :class:`TestOneJob`."""
    started = start_controller_job(devcluster, tmp_path_factory.mktemp("shared-job"))
    yield started
    stop_controller_job(started)


@pytest.fixture
def job_at_rest(shared_job: ControllerJob) -> ControllerJob:
    """The shared job with no worker and no cordon, as a fresh job starts."""
    with shared_job.client() as c:
        for gpu in shared_job.status()["cordoned_gpus"]:
            c.uncordon(gpu["node"], gpu["gpu"])
        c.scale(0)
    shared_job.active(0)
    wait_for(lambda: not shared_job.worker_steps(), 30, "every worker step to end")
    return shared_job


class TestOneJob:
    """Checks that need nothing but a job with default options share one (each starts at rest)."""

    def test_scale_0_6_2_5_pins_each_worker_to_its_own_gpu(self, job_at_rest: ControllerJob) -> None:
        job = job_at_rest
        with job.client() as c:
            for target in (6, 2, 5):
                c.scale(target)
                status = job.active(target)
                placed = [(w["node"], tuple(w["gpus"])) for w in status["workers"] if w["state"] == "ACTIVE"]
                assert len(set(placed)) == target  # no two workers share a GPU
        assert unfinished_rollouts_of_drained(job) == {}
        for worker, starts in starts_by_worker(job).items():
            for start in starts:  # Slurm's view (SLURM_STEP_GPUS) = the only device the step can open
                assert [int(g) for g in start["gpus"].split(",")] == start["openable"], worker
        active = [w for w in job.status()["workers"] if w["state"] == "ACTIVE"]
        # a worker registers (ACTIVE) a moment before its command writes its start event
        wait_for(lambda: all(w["worker_id"] in starts_by_worker(job) for w in active), 20, "start events")
        for w in active:  # and the controller's view is Slurm's
            last_start = starts_by_worker(job)[w["worker_id"]][-1]
            assert (w["node"], w["gpus"]) == (last_start["node"], last_start["openable"])
        steps = job.worker_steps()
        assert len(steps) == 5

    def test_cordoned_gpu_gets_no_worker_while_healthy_gpus_exist(self, job_at_rest: ControllerJob) -> None:
        job = job_at_rest
        with job.client() as c:
            c.cordon("node1", 0, "test cordon")
            c.cordon("node2", 3, "test cordon")
            c.scale(6)
            status = job.active(6)
        real = [(w["node"], w["gpus"][0]) for w in status["workers"] if w["state"] == "ACTIVE" and not w["placeholder"]]
        assert ("node1", 0) not in real and ("node2", 3) not in real
        assert len(set(real)) == 6  # the six healthy GPUs

    def test_one_squeue_per_tick(self, job_at_rest: ControllerJob) -> None:
        job = job_at_rest
        with job.client() as c:
            c.scale(4)
            job.active(4)
        before = job.status()["ticks"]
        slurmctld_before = _step_info_rpcs()
        wait_for(lambda: job.status()["ticks"] - before >= 6, 30, "six ticks")  # polling status adds no listing
        ticks = job.status()["ticks"] - before
        rpcs = _step_info_rpcs() - slurmctld_before
        # every tick lists steps once; status calls and agents add none (agents are off here)
        assert ticks >= 6 and rpcs <= ticks + 1, (ticks, rpcs)


def unfinished_rollouts_of_drained(job: ControllerJob) -> dict[str, set[int]]:
    drained = {e["worker"] for e in job.events() if e["event"] == "drained"}
    return {w: n for w, n in unfinished_rollouts(job).items() if w in drained}


@pytest.mark.parametrize("job", [{"worker_env": {"ROLLOUT_S": "3.0"}}], indirect=True)
def test_drain_finishes_the_rollout_in_flight_before_the_timeout(job: ControllerJob) -> None:
    with job.client() as c:
        c.scale(1)
        job.active(1)
        wait_for(lambda: any(e["event"] == "rollout_begin" for e in job.events()), 20, "a rollout to begin")
        c.scale(0)
    job.active(0, timeout_s=20)
    drained = [e for e in job.events() if e["event"] == "drained"]
    assert len(drained) == 1
    assert unfinished_rollouts(job) == {}  # the rollout in flight was finished, not lost
    # "drained" is written by the worker itself on its way out: it was not cancelled at the timeout
    assert job.worker_steps() == {}


@pytest.mark.parametrize("job", [{"worker_env": {"IGNORE_DRAIN": "1"}, "workers": {"drain_timeout_s": 3.0}}],
                         indirect=True)
def test_worker_that_ignores_the_drain_is_cancelled_at_the_timeout(job: ControllerJob) -> None:
    with job.client() as c:
        c.scale(1)
        job.active(1)
        c.scale(0)
    status = job.active(0, timeout_s=30)
    assert not any(e["event"] == "drained" for e in job.events())  # it never drained by itself
    assert job.worker_steps() == {}
    assert status["workers_by_state"]["FAILED"] == 0


def _step_info_rpcs() -> int:
    from slurm_elastic.slurm.cli_backend import SlurmCli

    return SlurmCli().rpc_counts().get("REQUEST_JOB_STEP_INFO", 0)


SDK_WORKER = str(Path(__file__).with_name("sdk_worker.py"))


@pytest.mark.parametrize("job", [{"workers": {"command": [sys.executable, SDK_WORKER]},
                                  "worker_env": {"ROLLOUT_S": "1.0"}}], indirect=True)
def test_sdk_worker_drains_gracefully_and_idle_workers_go_first(job: ControllerJob) -> None:
    with job.client() as c:
        c.scale(2)
        job.active(2)
        wait_for(lambda: {w["worker_id"]: w["busy"] for w in job.status()["workers"]} == {"0001": False, "0002": True},
                 15, "busy flags from SDK heartbeats")
        c.scale(1)
        status = job.active(1)
    assert [w["worker_id"] for w in status["workers"] if w["state"] == "ACTIVE"] == ["0002"]  # the idle one went
    with job.client() as c:
        c.scale(0)
    job.active(0)
    drained = {e["worker"]: e for e in job.events() if e["event"] == "drained"}
    assert set(drained) == {"0001", "0002"}
    assert drained["0002"]["rollouts"] >= 1 and unfinished_rollouts(job) == {}
