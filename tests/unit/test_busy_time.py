"""Busy time from heartbeats: the controller sums the increases of each worker's cumulative
``busy_s`` over the production window, the divisor of the autoscaler's per-worker rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.pause_watch import PauseWatch
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.lifecycle import resume, suspend
from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.core.speed import seconds_per_rollout
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.slurm.parse import StepInfo
from tests.stub_backend import ListedSteps


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def controller_with_two_workers(tmp: Path, clock: Clock, queue: RolloutQueue | None = None) -> Controller:
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    steps = [StepInfo(1, str(gpu + 3), worker_step_name(wid), ("node1",), "0:01", "", "gres/gpu:1", 1)
             for wid, gpu in (("0001", 0), ("0002", 1))]
    controller = Controller(config, 1, ListedSteps(steps), tmp, gpus_by_node={"node1": (0, 1)},  # type: ignore[arg-type]
                            clock=clock, queue=queue)
    controller.scale(2)
    controller.tick()  # the two steps are listed: they are this controller's workers
    for wid, gpu in (("0001", 0), ("0002", 1)):
        controller.register_worker(wid, {"node": "node1", "gpus": [gpu], "step_id": gpu + 3})
    return controller


def test_no_busy_reports_means_no_estimate(tmp_path: Path) -> None:
    clock = Clock()
    controller = controller_with_two_workers(tmp_path, clock)
    controller.heartbeat("0001", {"busy": True, "rollouts": 1})  # an SDK that sends no busy_s
    assert controller.busy_worker_s(clock()) is None


def test_one_worker_always_busy_and_one_half_busy_make_one_and_a_half(tmp_path: Path) -> None:
    clock = Clock()
    controller = controller_with_two_workers(tmp_path, clock)
    for tick in range(0, 121):  # a heartbeat a second for two minutes
        clock.now_s = 1000.0 + tick
        controller.heartbeat("0001", {"busy_s": float(tick)})
        controller.heartbeat("0002", {"busy_s": tick / 2})
    assert controller.busy_worker_s(clock()) == pytest.approx(1.5 * 120, rel=0.05)  # over the 120 s window


def test_a_restarted_worker_counting_from_zero_adds_no_negative_time(tmp_path: Path) -> None:
    clock = Clock()
    controller = controller_with_two_workers(tmp_path, clock)
    for tick, busy_s in enumerate([50.0, 51.0, 52.0, 1.0, 2.0, 3.0]):  # the SDK restarted at tick 3
        clock.now_s = 1050.0 + tick  # its first report 50 s after its registration
        controller.heartbeat("0001", {"busy_s": busy_s})
    # 50 s from its launch, +1 s a report after; the restart's report (1.0) counts as 1 s, not -51 s
    assert controller.busy_worker_s(clock()) == pytest.approx(55.0)


def test_a_report_past_the_time_since_the_last_counts_that_time_only(tmp_path: Path) -> None:
    """busy_s of 1e9 from a client with the token read as a per-worker production near 0 for the
    production window (the autoscaler asked for 12.7 million workers); the real reports after it,
    lower, were taken as the SDK's restart and counted whole. An increase now counts at most the
    time since the previous report, and two heartbeat intervals (one rollout runs at a time)."""
    clock = Clock()
    controller = controller_with_two_workers(tmp_path, clock)
    slack_s = 2 * controller.config.workers.heartbeat_interval_s
    for tick in range(1, 25):  # a report every 5 s for two minutes, busy all the time
        clock.now_s = 1000.0 + 5 * tick
        controller.heartbeat("0001", {"busy_s": 1e9 if tick == 12 else 5.0 * tick})
    assert controller.busy_worker_s(clock()) <= 120.0 + 2 * slack_s
    before = controller.busy_worker_s(clock())
    assert before is not None
    for report in range(50_000):  # many reports within a second, each 2 s more (a live re-check)
        clock.now_s += 1e-5
        controller.heartbeat("0002", {"busy_s": 2.0 * report})
    assert controller.busy_worker_s(clock()) - before <= 1.0 + slack_s


def test_a_new_workers_first_report_counts_whole(tmp_path: Path) -> None:
    """Its sequences count from its first rollout on: its busy time must too, or the per-worker
    rate reads a heartbeat interval's worth too high (3.6x in a live job's first seconds)."""
    clock = Clock()
    controller = controller_with_two_workers(tmp_path, clock)
    clock.now_s += 5.0
    controller.heartbeat("0001", {"busy_s": 4.5})
    assert controller.busy_worker_s(clock()) == pytest.approx(4.5)


def test_an_adopted_workers_first_report_is_where_counting_starts(tmp_path: Path) -> None:
    clock = Clock()
    controller_with_two_workers(tmp_path, clock)
    clock.now_s += 3600.0
    restarted = Controller(parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}}), 1,
                           ListedSteps([]), tmp_path, gpus_by_node={"node1": (0, 1)}, clock=clock)  # type: ignore[arg-type]
    restarted.heartbeat("0001", {"busy_s": 3000.0})  # an hour of busy time, before this controller started
    clock.now_s += 5.0
    restarted.heartbeat("0001", {"busy_s": 3005.0})
    assert restarted.busy_worker_s(clock()) == pytest.approx(5.0)


def test_the_sdk_counts_time_inside_rollouts_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from slurm_elastic.worker import RolloutWorker

    now = [100.0]
    monkeypatch.setattr("slurm_elastic.worker.time.monotonic", lambda: now[0])
    worker = RolloutWorker.__new__(RolloutWorker)  # no controller: only the busy-time bookkeeping
    worker._busy, worker._busy_s, worker._rollout_since, worker.rollouts = False, 0.0, None, 0
    with worker.rollout():
        now[0] += 3.0
        assert worker.busy_s == pytest.approx(3.0)  # the rollout in flight counts
    now[0] += 10.0  # waiting at the admission gate: not busy
    with pytest.raises(RuntimeError), worker.rollout():
        now[0] += 2.0
        raise RuntimeError("environment crashed")
    assert worker.busy_s == pytest.approx(5.0) and worker.rollouts == 1



def test_a_rollout_in_flight_counts_on_until_the_next_report(tmp_path: Path) -> None:
    """Sequences count when they arrive; busy time would count only at the next heartbeat."""
    clock = Clock()
    controller = controller_with_two_workers(tmp_path, clock)
    clock.now_s += 5.0
    controller.heartbeat("0001", {"busy": True, "busy_s": 5.0})
    controller.heartbeat("0002", {"busy": False, "busy_s": 1.0})  # waiting at the gate since
    clock.now_s += 3.0
    assert controller.busy_worker_s(clock()) == pytest.approx(5.0 + 1.0 + 3.0)
    clock.now_s += 60.0  # silent for long (its step died): at most two heartbeat intervals more
    assert controller.busy_worker_s(clock()) == pytest.approx(6.0 + 2 * 5.0)


def test_a_jobs_first_seconds_read_a_workers_production_as_it_is(tmp_path: Path) -> None:
    """Two workers make a group of 8 every second from the start, heartbeats every 5 s (the SDK's
    default): 11 s in, the autoscaler's per-worker rate reads 8 seqs/s. Counting the first
    report as a baseline and nothing since the last one read 17.6 (a live job's sizing step cut
    its pool to one worker on such a reading)."""
    clock = Clock()
    queue = RolloutQueue(RolloutStore(tmp_path / "q.sqlite", fsync="off"),
                         QueueConfig(batch_size=64, max_staleness=1000), clock=clock)
    controller = controller_with_two_workers(tmp_path, clock, queue)
    for second in range(1, 12):
        clock.now_s = 1000.0 + second
        for wid in ("0001", "0002"):
            assert queue.admit(8, wid) == 8
            queue.submit(f"{wid}-{second}", wid, 8, 0, b"x" * 8)
            if second % 5 == 0:
                controller.heartbeat(wid, {"busy": True, "busy_s": float(second)})
    rate = controller.pressure_inputs(8, clock()).per_worker_seqs_per_s
    assert rate == pytest.approx(8.0, rel=0.05)
    queue.store.close()


def test_the_time_a_suspended_job_stood_still_is_not_busy_time(tmp_path: Path) -> None:
    """Found by a live audit: after `scontrol suspend` for 60 s, the busy time the SDK counted
    while stopped was credited, the per-worker production read ~0.6x, and the autoscaler took
    every GPU."""
    clock = Clock()
    controller = controller_with_two_workers(tmp_path, clock)
    for tick in range(0, 31):  # always busy, a heartbeat a second
        clock.now_s = 1000.0 + tick
        controller.heartbeat("0001", {"busy_s": float(tick), "busy": True})
    clock.now_s += 60.0  # suspended: nobody ran
    controller.move_busy_clocks_on(60.0)
    clock.now_s += 1.0
    controller.heartbeat("0001", {"busy_s": 30.0 + 61.0, "busy": True})  # its SDK's clock ran on
    slack_s = 2 * controller.config.workers.heartbeat_interval_s  # what a report may run ahead, as ever
    assert controller.busy_worker_s(clock()) <= 30.0 + 1.0 + slack_s  # not the 60 s it stood still (91 before)


class Workers:
    """Three workers, always inside a rollout (1 s each) and heart-beating every 5 s; the first of
    them is inside one when the job is suspended, the others at the gate. Its SDK's clock runs on
    while stopped."""

    IDS = ("0001", "0002", "0003")

    def __init__(self, tmp: Path, clock: Clock) -> None:
        self.clock = clock
        config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
        steps = [StepInfo(1, str(gpu + 3), worker_step_name(wid), ("node1",), "0:01", "", "gres/gpu:1", 1)
                 for gpu, wid in enumerate(self.IDS)]
        self.controller = Controller(config, 1, ListedSteps(steps), tmp, gpus_by_node={"node1": (0, 1, 2)},  # type: ignore[arg-type]
                                     clock=clock)
        self.controller.scale(3)
        self.controller.tick()
        for gpu, wid in enumerate(self.IDS):
            self.controller.register_worker(wid, {"node": "node1", "gpus": [gpu], "step_id": gpu + 3})
        self.watch = self.controller.pause_watch = PauseWatch(clock=clock)
        self.ran_s = 0.0
        self.busy_s = dict.fromkeys(self.IDS, 0.0)  # as each SDK counts

    def run(self, seconds: int) -> None:
        for _ in range(seconds):
            self.clock.now_s += 1.0
            self.watch.beat()
            self.ran_s += 1.0
            for wid in self.IDS:
                self.busy_s[wid] += 1.0
            if self.ran_s % 5 == 0:
                self.controller.tick()
                for wid in self.IDS:
                    self.heartbeat(wid)

    def suspend(self, seconds: float) -> None:
        self.clock.now_s += seconds  # nothing ran, not the pause watch either
        self.busy_s["0001"] += seconds
        self.clock.now_s += 0.2

    def heartbeat(self, worker_id: str) -> None:
        self.controller.heartbeat(worker_id, {"busy": True, "rollouts": int(self.ran_s) - 1,
                                              "busy_s": self.busy_s[worker_id]})

    def view(self, worker_id: str) -> dict[str, Any]:
        return next(w for w in self.controller.status()["workers"] if w["worker_id"] == worker_id)


@pytest.mark.parametrize("first", ["tick", "heartbeat"])
def test_a_worker_busy_while_its_job_was_suspended_is_not_slow(tmp_path: Path, first: str) -> None:
    """An operator's audit: after `scontrol suspend` for 22 s, a healthy worker read 1.8 s a rollout
    against 1.0, "(slow)", 1.4 a minute later, and was drained first. The pause is left out whether
    the tick notices it first or the worker's first heartbeat after the resume comes before."""
    workers = Workers(tmp_path, Clock())
    workers.run(20)
    assert workers.view("0001")["seconds_per_rollout"] == 1.0
    workers.suspend(22.0)
    if first == "tick":
        workers.controller.tick()
        workers.heartbeat("0001")
    else:
        workers.heartbeat("0001")
        workers.controller.tick()
    for wid in ("0002", "0003"):
        workers.heartbeat(wid)
    view = workers.view("0001")
    assert view["seconds_per_rollout"] == pytest.approx(1.0, abs=0.05) and not view["slow"]  # 42 / 20 before
    workers.run(60)
    view = workers.view("0001")
    assert view["seconds_per_rollout"] == pytest.approx(1.0, abs=0.02) and not view["slow"]
    assert workers.controller.state.workers["0001"].paused_busy_s == pytest.approx(22.0, abs=0.5)


def test_the_time_left_out_outlives_a_controller_restart(tmp_path: Path) -> None:
    workers = Workers(tmp_path, Clock())
    workers.run(20)
    workers.suspend(22.0)
    workers.heartbeat("0001")
    workers.controller.save()
    restarted = Controller(parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}}), 1,
                           ListedSteps([]), tmp_path, gpus_by_node={"node1": (0, 1, 2)}, clock=workers.clock)  # type: ignore[arg-type]
    worker = restarted.state.workers["0001"]
    assert worker.paused_busy_s == pytest.approx(21.7, abs=0.5)
    assert seconds_per_rollout(worker) == pytest.approx(1.0, abs=0.05)


def test_a_state_file_from_before_the_stopped_time_loads() -> None:
    from slurm_elastic.controller.state_model import WorkerRecord

    record = WorkerRecord.model_validate({"worker_id": "0001", "state": "ACTIVE", "rollouts": 8, "busy_s": 8.0})
    assert record.to_worker().paused_busy_s == 0.0


@pytest.mark.parametrize("first", ["tick", "heartbeat"])
def test_a_burst_workers_time_suspended_with_its_job_is_not_slowness(tmp_path: Path, first: str) -> None:
    """A burst job suspended alone: the controller runs on (no pause for the pause watch), its worker
    stands SUSPENDED, and its SDK's clock runs on inside the rollout. Whether the tick resumes it
    first or its first heartbeat comes while it still stands SUSPENDED, the time is left out."""
    workers = Workers(tmp_path, Clock())
    workers.run(20)
    worker = workers.controller.state.workers["0001"]
    suspend(worker, workers.clock.now_s, "its burst job is suspended")
    for _ in range(22):
        workers.clock.now_s += 1.0
        workers.watch.beat()
    workers.busy_s["0001"] += 22.0
    if first == "tick":
        resume(worker, workers.clock.now_s, "its burst job runs again")
        workers.heartbeat("0001")
    else:
        workers.heartbeat("0001")
        resume(worker, workers.clock.now_s, "its burst job runs again")
    view = workers.view("0001")
    assert view["seconds_per_rollout"] == pytest.approx(1.0, abs=0.05) and not view["slow"]
    assert worker.paused_busy_s == pytest.approx(22.0, abs=0.5) and worker.stood_s == pytest.approx(22.0)


def test_a_burst_workers_time_suspended_across_a_controller_restart_is_not_slowness(tmp_path: Path) -> None:
    """A live probe: a burst job suspended, the controller killed (-9) and restarted while it stood,
    then resumed after 29 s: its workers read 1.4 s a rollout against 1.0, "(slow)". The restarted
    controller had not heard them before, so their first report's busy time was taken whole, the
    time they stood inside a rollout with it."""
    workers = Workers(tmp_path, Clock())
    workers.run(20)
    suspend(workers.controller.state.workers["0001"], workers.clock.now_s, "its burst job is suspended")
    workers.controller.save()
    workers.clock.now_s += 5.0
    restarted = Controller(parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}}), 1,
                           ListedSteps([]), tmp_path, gpus_by_node={"node1": (0, 1, 2)}, clock=workers.clock)  # type: ignore[arg-type]
    restarted.pause_watch = PauseWatch(clock=workers.clock)
    worker = restarted.state.workers["0001"]
    workers.clock.now_s += 24.0
    workers.busy_s["0001"] += 29.0  # inside a rollout the whole time it stood
    resume(worker, workers.clock.now_s, "its burst job runs again")
    workers.controller = restarted
    workers.heartbeat("0001")
    assert seconds_per_rollout(worker) == pytest.approx(1.0, abs=0.05)
    assert worker.paused_busy_s == pytest.approx(29.0, abs=0.5)
