"""The controller in process, fed Slurm listings recorded on the dev cluster (the CLI backend's
``squeue --steps`` output; tests/unit/data/record_controller_steps.sh): adoption after a restart,
scale up and down, crash -> backoff -> relaunch, health drain, a pending step. A stub backend
lists the recorded steps and records the actions; the clock is passed in."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.controller import runtime
from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.defaults import STEP_END_SETTLE_S
from slurm_elastic.core.health import AgentReport, GpuSample
from slurm_elastic.core.lifecycle import WorkerState
from slurm_elastic.core.reconcile import Drain, Launch
from slurm_elastic.slurm.backend import StepSpec
from slurm_elastic.slurm.parse import StepInfo, parse_step_lines
from slurm_elastic.status_view import render_status
from tests.stub_backend import ListedSteps

DATA = Path(__file__).parent / "data"
S = WorkerState


def listing(situation: str) -> list[StepInfo]:
    return parse_step_lines((DATA / f"controller_steps_{situation}.txt").read_text())


RUNNING = listing("running")
JOB_ID = RUNNING[0].job_id
NODES = sorted({n for s in RUNNING for n in s.nodes})
TRAINER_NODE = next(s.nodes[0] for s in RUNNING if s.name == "trainer")


class Recorded(ListedSteps):
    """Lists what it is given; records launches, signals and cancels."""

    def __init__(self, steps: list[StepInfo]) -> None:
        super().__init__(steps)
        self.launched: list[StepSpec] = []
        self.signalled: list[tuple[int, str, str]] = []
        self.cancelled: list[tuple[int, str]] = []

    def launch_step(self, spec: StepSpec, launcher_log: Path) -> int:
        self.launched.append(spec)
        return 0

    def signal_step(self, job_id: int, step_id: str, signal_name: str) -> None:
        self.signalled.append((job_id, step_id, signal_name))

    def cancel_step(self, job_id: int, step_id: str) -> None:
        self.cancelled.append((job_id, step_id))


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def make(tmp: Path, steps: list[StepInfo], clock: Clock, backoff_base_s: float = 5.0,
         health: dict[str, Any] | None = None) -> tuple[Controller, Recorded]:
    """A controller of the recorded job; the autoscaler is off (the target: seeded, or the operator's)."""
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0, "enable_elastic": False},
                           "workers": {"backoff_base_s": backoff_base_s}, "health": health or {}})
    backend = Recorded(steps)
    controller = Controller(config, JOB_ID, backend, tmp,  # type: ignore[arg-type]
                            gpus_by_node={n: (0, 1, 2, 3) for n in NODES}, clock=clock)
    return controller, backend


def register_all(controller: Controller, steps: list[StepInfo]) -> None:
    """Each worker step registers where Slurm put it (one GPU each, in listing order per node)."""
    used: dict[str, int] = {TRAINER_NODE: 2}
    for step in steps:
        if step.name.startswith("se-w-"):
            node = step.nodes[0]
            controller.register_worker(step.name.removeprefix("se-w-"),
                                       {"node": node, "gpus": [used.get(node, 0)], "step_id": step.step_id})
            used[node] = used.get(node, 0) + 1


def step_of(worker_id: str, steps: list[StepInfo] = RUNNING) -> str:
    return next(s.step_id for s in steps if s.name == f"se-w-{worker_id}")


def test_the_recorded_listing_is_three_workers_and_a_trainer_on_two_gpus() -> None:
    assert sorted(s.name for s in RUNNING if s.name != "batch") == ["se-w-0001", "se-w-0002", "se-w-0003", "trainer"]
    assert len(NODES) == 2


def test_a_restart_without_state_adopts_every_running_step_and_launches_nothing(tmp_path: Path) -> None:
    clock = Clock()
    controller, backend = make(tmp_path, RUNNING, clock)
    result = controller.tick()
    assert backend.launched == [] and result.actions == []
    assert controller.state.target_workers == 3  # seeded from what Slurm runs: a live fleet is kept
    assert {w: (r.state, r.step_id, r.job_id) for w, r in controller.workers.items()} == {
        w: (S.STARTING, step_of(w), JOB_ID) for w in ("0001", "0002", "0003")}
    assert sum(s.slots for s in result.slots) == 6  # 8 GPUs, the trainer holds 2
    register_all(controller, RUNNING)
    controller.tick()
    clock.now_s += 60
    again, backend2 = make(tmp_path, RUNNING, clock)  # kill -9 and restart: the saved records
    again.tick()
    assert backend2.launched == [] and backend2.cancelled == []
    assert all(w.state is S.ACTIVE and w.launches == 1 for w in again.workers.values())  # adopted: launched once


def test_a_controller_back_after_the_agents_silence_limit_keeps_their_nodes_usable(tmp_path: Path) -> None:
    clock = Clock()

    def with_agents() -> Controller:
        config = parse_config({"autoscaler": {"min_workers": 0, "enable_elastic": False}})
        return Controller(config, JOB_ID, Recorded(RUNNING), tmp_path,  # type: ignore[arg-type]
                          gpus_by_node={n: (0, 1, 2, 3) for n in NODES}, clock=clock)

    controller = with_agents()
    controller.tick()
    register_all(controller, RUNNING)
    for node in NODES:
        controller.report_gpu_health(AgentReport(node, clock.now_s, "nvml", [
            GpuSample(node, g, temperature_c=50.0, memory_used_mb=0, memory_total_mb=80000) for g in range(4)]))
    controller.tick()
    assert controller.usable_slots == 6
    clock.now_s += 2 * controller.health_rules.agent_silence_s  # down that long: no agent could report
    again = with_agents()
    again.tick()
    assert again.usable_slots == 6  # not 0 until each agent's next report
    assert "note" not in again.scale(3)


def test_scale_up_fills_the_free_gpus_of_the_allocation_and_no_more(tmp_path: Path) -> None:
    controller, backend = make(tmp_path, RUNNING, Clock())
    controller.tick()
    answer = controller.scale(10)
    assert answer["note"] == ("10 workers asked; 6 GPU slots are usable now, so 6 run and the rest wait for GPUs "
                              "(a lifted cordon)")  # no [burst] table: no burst job to wait for
    with_burst = Controller(parse_config({"agent": {"enabled": False}, "burst": {"max_jobs": 2, "gpus_per_job": 2}}), 7,
                            ListedSteps(), tmp_path / "burst", gpus_by_node={"a1": (0, 1)})  # type: ignore[arg-type]
    with_burst.usable_slots = 6  # 2 of its own, 2 burst jobs of 2: no third comes (a live probe's note said "a burst job")
    assert with_burst.scale(10)["note"].endswith("(a lifted cordon, a held or suspended burst job let go; burst "
                                                 "jobs up to burst.max_jobs = 2, held or suspended ones aside, are "
                                                 "counted in already)")
    controller.state.autoscaler.config = dataclasses.replace(controller.state.autoscaler.config, max_workers=8)
    assert controller.scale(9)["note"].endswith("; above autoscaler.max_workers (8): a manual target is not bound by it")
    assert "note" not in controller.scale(6)
    controller.scale(10)
    result = controller.tick()
    launches = [a for a in result.actions if isinstance(a, Launch)]
    assert [a.worker_id for a in launches] == ["0004", "0005", "0006"]  # 6 slots, 3 held
    text = render_status(JOB_ID, {"controller": controller.status()}, now_s=controller.clock())
    assert "target: 10 workers (paused; only 6 GPU slots usable now)" in text
    assert all(a.job_id == JOB_ID for a in launches)
    assert [s.job_id for s in backend.launched] == [JOB_ID] * 3
    assert all(controller.workers[a.worker_id].job_id == JOB_ID for a in launches)


def test_scale_down_drains_the_idle_worker_first_with_its_steps_job(tmp_path: Path) -> None:
    controller, backend = make(tmp_path, RUNNING, Clock())
    controller.tick()
    register_all(controller, RUNNING)
    for worker_id, busy in (("0001", True), ("0002", False), ("0003", True)):
        controller.heartbeat(worker_id, {"busy": busy})
    controller.scale(2)
    result = controller.tick()
    assert [a for a in result.actions if isinstance(a, Drain)] == [Drain("0002", step_of("0002"), JOB_ID)]
    assert backend.signalled == [(JOB_ID, step_of("0002"), "USR1")]
    assert controller.workers["0002"].state is S.DRAINING
    assert controller.heartbeat("0002", {})["drain"] is True
    backend.steps = listing("vanished")  # the drained step ended by itself
    controller.tick()
    assert controller.workers["0002"].state is S.INACTIVE and backend.launched == []
    (ended,) = controller.status()["ended_workers"]
    assert ended["worker_id"] == "0002" and ended["reason"] == "drained (scale-down to 2); step ended after drain"
    text = render_status(JOB_ID, {"controller": controller.status()}, now_s=controller.clock())
    assert "ended last:" in text and "drained (scale-down to 2); step ended after drain" in text


def test_scale_down_drains_the_worker_its_heartbeats_show_slow_first(tmp_path: Path) -> None:
    controller, _ = make(tmp_path, RUNNING, Clock())
    controller.tick()
    register_all(controller, RUNNING)
    for worker_id, busy_s in (("0001", 50.0), ("0002", 90.0), ("0003", 48.0)):  # 0002 on an older GPU
        controller.heartbeat(worker_id, {"busy": worker_id != "0003", "rollouts": 5, "busy_s": busy_s})
    text = render_status(JOB_ID, {"controller": controller.status()}, now_s=controller.clock())
    assert "S/ROLLOUT" in text and "15.0 (slow)" in text and "8.3 " in text  # 90 s, 50 s / (5 + 1 in flight)
    controller.scale(2)
    result = controller.tick()
    assert [a.worker_id for a in result.actions if isinstance(a, Drain)] == ["0002"]  # not 0003, the idle one


def test_a_vanished_worker_backs_off_and_is_relaunched_under_the_same_id(tmp_path: Path) -> None:
    clock = Clock()
    controller, backend = make(tmp_path, RUNNING, clock)
    controller.tick()
    register_all(controller, RUNNING)
    backend.steps = listing("vanished")
    controller.tick()
    worker = controller.workers["0002"]
    assert (worker.state, worker.crash_count) == (S.ACTIVE, 0)  # gone without a word: Slurm's may follow
    clock.now_s += STEP_END_SETTLE_S
    controller.tick()
    assert (worker.state, worker.crash_count, worker.backoff_until_s) == (S.BACKOFF, 1, clock.now_s + 5.0)
    clock.now_s += 4.9
    controller.tick()
    assert backend.launched == []
    clock.now_s += 0.1
    result = controller.tick()
    assert [a.worker_id for a in result.actions if isinstance(a, Launch)] == ["0002"]
    assert (worker.state, worker.launches) == (S.STARTING, 2)  # adopted (its first), then relaunched
    assert [s.name for s in backend.launched] == ["se-w-0002"]


def test_a_worker_on_an_unhealthy_gpu_is_drained_and_replaced_elsewhere(tmp_path: Path) -> None:
    clock = Clock()
    controller, backend = make(tmp_path, RUNNING, clock)
    controller.tick()
    register_all(controller, RUNNING)
    hot = controller.workers["0001"]
    samples = [GpuSample(hot.node, g, temperature_c=50.0, clock_event_reasons=frozenset(
        {"hw_thermal_slowdown"} if g == hot.gpus[0] else set()), memory_used_mb=0, memory_total_mb=80000)
        for g in range(4)]
    controller.report_gpu_health(AgentReport(hot.node, clock.now_s, "nvml", samples))
    result = controller.tick()
    assert hot.state is S.DRAINING and "unhealthy: hw_thermal_slowdown" in hot.history[-1][3]
    assert backend.signalled == [(JOB_ID, hot.step_id, "USR1")]
    assert [a.worker_id for a in result.actions if isinstance(a, Launch)] == ["0004"]  # the target still asks for 3
    assert sum(s.slots for s in result.slots) == 5


def test_a_pending_worker_step_is_not_listed_and_counts_as_starting_until_the_start_timeout(tmp_path: Path) -> None:
    """Slurm 22.05 lists no pending step (srun waits for the GPU before the step exists): the
    recorded listing while se-w-0004 waited for a GPU on a full node has no trace of it."""
    assert [s.name for s in listing("pending")] == [s.name for s in listing("vanished")]
    clock = Clock()
    controller, backend = make(tmp_path, listing("vanished"), clock)
    controller.tick()
    controller.scale(3)
    controller.tick()
    assert [s.name for s in backend.launched] == ["se-w-0004"]
    backend.steps = listing("pending")
    timeout_s = controller.config.workers.start_timeout_s
    clock.now_s += timeout_s - 0.1
    controller.tick()
    worker = controller.workers["0004"]
    assert (worker.state, worker.crash_count) == (S.STARTING, 0)
    clock.now_s += 0.1
    controller.tick()
    assert (worker.state, worker.crash_count) == (S.BACKOFF, 1)
    assert worker.history[-2][3] == "step never appeared in Slurm"


def sruns_running(monkeypatch: pytest.MonkeyPatch, *worker_ids: str) -> None:
    """This host's srun processes, as the next controller reads them: one for each of ``worker_ids``."""
    monkeypatch.setattr(runtime, "running_step_launches", lambda: {(JOB_ID, f"se-w-{w}") for w in worker_ids})


def test_a_controller_killed_mid_scale_up_waits_for_the_launched_steps_and_relaunches_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kill -9 once a scale-up's launches are saved, before Slurm lists their steps: the next
    controller counts them as starting (their sruns wait for GPUs), takes their steps when listed,
    and launches nothing."""
    clock = Clock()
    controller, backend = make(tmp_path, RUNNING, clock)
    controller.tick()
    register_all(controller, RUNNING)
    controller.scale(5)
    controller.tick()
    assert [s.name for s in backend.launched] == ["se-w-0004", "se-w-0005"]
    sruns_running(monkeypatch, "0004", "0005")
    clock.now_s += 1.0
    again, backend2 = make(tmp_path, RUNNING, clock)  # the new steps are not listed yet
    again.tick()
    assert backend2.launched == [] and backend2.cancelled == []
    worker_step = next(s for s in RUNNING if s.name == "se-w-0002")  # on node2, where GPUs are free
    started = [dataclasses.replace(worker_step, step_id=str(10 + i), name=f"se-w-{w}")
               for i, w in enumerate(("0004", "0005"))]
    backend2.steps = [*RUNNING, *started]
    clock.now_s += 1.0
    again.tick()
    for gpu, step in enumerate(started, start=1):  # 0002 holds node2's GPU 0
        again.register_worker(step.name.removeprefix("se-w-"), {"node": step.nodes[0], "gpus": [gpu],
                                                                "step_id": step.step_id})
    clock.now_s += 1.0
    again.tick()
    assert backend2.launched == [] and backend2.cancelled == [] and backend2.signalled == []
    assert {w: (r.state, r.launches) for w, r in again.workers.items()} == {
        "0001": (S.ACTIVE, 1), "0002": (S.ACTIVE, 1), "0003": (S.ACTIVE, 1), "0004": (S.ACTIVE, 1),
        "0005": (S.ACTIVE, 1)}
    assert [again.workers[w].step_id for w in ("0004", "0005")] == ["10", "11"]


class Killed(BaseException):
    """The controller's process dies (kill -9) in the middle of an action."""


def test_a_controller_killed_while_its_launches_run_has_saved_them_first(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Launches are written to the state file before srun runs: a kill -9 after the first srun
    of a scale-up leaves records the next controller waits for, so no worker id is launched twice.
    The launch whose srun never ran (no step listed, no srun on the host) is launched again at
    once, not counted as a crash; before, it waited ``start_timeout_s`` and counted one."""
    clock = Clock()
    controller, backend = make(tmp_path, RUNNING, clock)
    controller.tick()
    register_all(controller, RUNNING)
    controller.scale(5)

    def die_after_one(spec: StepSpec, launcher_log: Path) -> int:
        backend.launched.append(spec)
        raise Killed

    backend.launch_step = die_after_one  # type: ignore[method-assign]
    with pytest.raises(Killed):
        controller.tick()
    assert [s.name for s in backend.launched] == ["se-w-0004"]
    sruns_running(monkeypatch, "0004")  # its step waits for a GPU: not listed yet
    clock.now_s += 1.0
    again, backend2 = make(tmp_path, RUNNING, clock)
    again.tick()
    assert [s.name for s in backend2.launched] == ["se-w-0005"]  # at once, and 0004 not again
    assert backend2.cancelled == [] and again.workers["0004"].state is S.STARTING
    relaunched = again.workers["0005"]
    assert (relaunched.state, relaunched.crash_count, relaunched.launches) == (S.STARTING, 0, 2)
    assert any(h[3].startswith("its launch was saved, but no srun runs for it") for h in relaunched.history)
    clock.now_s += 1.0
    again.tick()
    assert [s.name for s in backend2.launched] == ["se-w-0005"]  # its own srun runs now: checked once
    assert again.cordoned_gpus() == {}


def kill_at(backend: Recorded, method: str) -> None:
    """The controller is killed -9 right after the backend's ``method`` (signal or cancel) ran."""
    record = getattr(backend, method)

    def then_die(*args: Any) -> None:
        record(*args)
        raise Killed

    setattr(backend, method, then_die)


@pytest.mark.parametrize("how", ["scale-down", "operator"])
def test_a_controller_killed_after_a_drain_signal_has_saved_the_drain_first(tmp_path: Path, how: str) -> None:
    """A drain's record is written before its signal is sent: the worker that drained and left
    while no controller ran ends as drained (no crash against its GPU, no relaunch). Before, the
    successor found an ACTIVE record whose step was gone: a crash, a relaunch, the drain undone."""
    clock = Clock()
    controller, backend = make(tmp_path, RUNNING, clock)
    controller.tick()
    register_all(controller, RUNNING)
    kill_at(backend, "signal_step")
    with pytest.raises(Killed):
        if how == "operator":
            controller.drain("0002")
        else:
            controller.scale(2)
            controller.tick()
    (signalled,) = backend.signalled
    gone = next(w for w in ("0001", "0002", "0003") if step_of(w) == signalled[1])
    steps = [s for s in RUNNING if s.name != f"se-w-{gone}"]  # it drained and left while none ran
    clock.now_s += 5.0
    again, backend2 = make(tmp_path, steps, clock)
    again.tick()
    worker = again.workers[gone]
    assert (worker.state, worker.crash_count) == (S.INACTIVE, 0) and worker.history[-1][3] == "step ended after drain"
    assert not any(g.crashes_s for g in again.state.cordons._gpus.values())  # none against its GPU
    # a scale-down launches nothing; the operator's drain keeps the count: a new worker, not this one again
    assert [spec.name for spec in backend2.launched] == ([] if how == "scale-down" else ["se-w-0004"])


def test_a_controller_killed_after_its_own_cancel_still_counts_it(tmp_path: Path) -> None:
    """A cancel for a lost heartbeat is saved (the worker DRAINING, why) before the scancel: its
    successor counts the step's end against its GPU. Before, it read as a cancel by someone else."""
    clock = Clock()
    controller, backend = make(tmp_path, RUNNING, clock)
    controller.tick()
    register_all(controller, RUNNING)
    for worker_id in ("0001", "0003"):
        controller.workers[worker_id].last_heartbeat_s = clock.now_s + 1000  # only 0002 falls silent
    clock.now_s += 600.0
    kill_at(backend, "cancel_step")
    with pytest.raises(Killed):
        controller.tick()
    assert backend.cancelled == [(JOB_ID, step_of("0002"))]
    clock.now_s += 5.0
    again, _backend2 = make(tmp_path, listing("vanished"), clock)
    for worker_id in ("0001", "0003"):
        again.workers[worker_id].last_heartbeat_s = clock.now_s + 1000
    again.tick()
    worker = again.workers["0002"]
    assert worker.crash_count == 1 and "no heartbeat" in " ".join(h[3] for h in worker.history[-3:])


def test_a_crash_loop_backs_off_exponentially_and_cordons_the_gpu(tmp_path: Path) -> None:
    clock = Clock()
    controller, backend = make(tmp_path, RUNNING, clock, backoff_base_s=1.0,
                               health={"crash_threshold": 3, "crash_window_s": 600.0})
    controller.tick()
    register_all(controller, RUNNING)
    worker = controller.workers["0002"]
    gpu = (worker.node, worker.gpus[0])
    for crash in range(1, 4):
        worker.exit_code = 1  # its command exits (the wrapper reports it): the step is gone
        backend.steps = listing("vanished")
        controller.tick()
        assert (worker.state, worker.crash_count) == (S.BACKOFF, crash)
        clock.now_s = worker.backoff_until_s
        result = controller.tick()
        assert [a.worker_id for a in result.actions if isinstance(a, Launch)] == ["0002"]
        backend.steps = RUNNING
        controller.tick()
        if crash < 3:
            controller.register_worker("0002", {"node": gpu[0], "gpus": [gpu[1]], "step_id": step_of("0002")})
    backoffs = [float(h[3].split()[2]) for h in worker.history if h[2] == "BACKOFF"]
    assert backoffs == [1.0, 2.0, 4.0]
    entry = controller.state.cordons.cordoned()[gpu]
    assert entry.source == "crash" and "3 worker crashes" in entry.reason
    assert "(the last: worker 0002, step ended unexpectedly (exit code 1); its output: logs/worker-0002.out)" in entry.reason
    assert sum(s.slots for s in controller.tick().slots) == 5  # the cordoned GPU is out of placement
