"""A rollout worker whose step gets the drain signal from outside (``scancel --signal=USR1
JOB.STEP`` by hand, Slurm's ``--signal`` before a burst job's time limit): its wrapper says
``leaving`` in a heartbeat, and the controller drains it from then as one it drained itself
(DRAINING at once, its replacement launched once a GPU is free, "drained" when its step ends).
Before, the controller saw nothing until the step's clean exit: ACTIVE meanwhile, the replacement
only after, and the worker ended as "exited cleanly"."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.autoscaler_config import AutoscalerConfig
from slurm_elastic.core.cordons import CordonBook
from slurm_elastic.core.lifecycle import Worker, WorkerState
from slurm_elastic.core.naming import worker_step_name
from slurm_elastic.core.placement import Allocation
from slurm_elastic.core.reconcile import Launch, ObservedStep, ReconcileConfig
from slurm_elastic.core.scaling import Autoscaler
from slurm_elastic.core.tick import ControlState, Observation, TickConfig, tick
from slurm_elastic.slurm.parse import StepInfo
from tests.stub_backend import ListedSteps, run_workers

S = WorkerState


def test_a_worker_whose_step_got_the_drain_signal_drains_and_is_replaced(tmp_path: Path) -> None:
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"enabled": False},
                           "workers": {"initial_workers": 2}})
    backend = ListedSteps()
    controller = Controller(config, 1, backend, tmp_path, gpus_by_node={"node1": (0, 1, 2)})  # type: ignore[arg-type]
    controller.tick()
    run_workers(controller, backend, 2)
    controller.tick()
    assert [w.state for w in controller.workers.values()] == [S.ACTIVE, S.ACTIVE]

    assert controller.heartbeat("0002", {"leaving": True})["drain"] is True
    worker = controller.workers["0002"]
    assert worker.state is S.DRAINING and worker.history[-1][3].startswith("the drain signal reached its step")
    controller.tick()  # a GPU is free: its replacement starts now, not after its exit
    assert {w.worker_id: w.state for w in controller.workers.values()} == {
        "0001": S.ACTIVE, "0002": S.DRAINING, "0003": S.STARTING}
    assert controller.heartbeat("0001", {"busy": True})["drain"] is False  # the others run on
    del backend.steps[1]  # its step ends after the rollout it finished
    controller.heartbeat("0002", {"exit_code": 0})
    controller.tick()
    assert controller.workers["0002"].state is S.INACTIVE
    assert controller.workers["0002"].history[-1][3] == "step ended after drain"


@pytest.mark.parametrize(("signal_name", "said"), [
    ("SIGUSR1", "(SIGUSR1: scancel --signal, or Slurm's --signal)"),
    ("SIGTERM", "(SIGTERM: an operator's scancel, a preemption's grace time, its job's time limit or a "
                "requeue)"),  # a burst job's worker: Slurm sends its steps SIGTERM for each
    (None, "(scancel --signal, or Slurm's)"),  # a wrapper that does not say
])
def test_the_reason_names_the_signal_the_wrapper_saw(tmp_path: Path, signal_name: str | None, said: str) -> None:
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"enabled": False},
                           "workers": {"initial_workers": 1}})
    backend = ListedSteps()
    controller = Controller(config, 1, backend, tmp_path, gpus_by_node={"node1": (0,)})  # type: ignore[arg-type]
    controller.tick()
    backend.steps.append(StepInfo(1, "1", worker_step_name("0001"), ("node1",), "0:01", "", "gres/gpu:1", 1))
    controller.register_worker("0001", {"node": "node1", "gpus": [0], "step_id": "1"})
    controller.tick()
    beat = {"leaving": True} if signal_name is None else {"leaving": True, "leaving_signal": signal_name}
    assert controller.heartbeat("0001", beat)["drain"] is True
    assert controller.workers["0001"].history[-1][3] == f"the drain signal reached its step {said}"


def test_a_burst_worker_drained_by_its_step_marks_its_job_as_ending() -> None:
    """Slurm's ``--signal`` before a burst job's time limit: nothing new goes to that job from the
    first such heartbeat on, and its other workers drain."""
    own, burst = Allocation(7, {"a1": (0,)}), Allocation(9, {"b1": (0, 1)})
    state = ControlState(autoscaler=Autoscaler(AutoscalerConfig(enabled=False)), cordons=CordonBook(), target_workers=3)
    for wid, job, node, gpu in (("0001", 7, "a1", 0), ("0002", 9, "b1", 0), ("0003", 9, "b1", 1)):
        state.workers[wid] = Worker(wid, state=S.ACTIVE, job_id=job, step_id=wid[-1], node=node, gpus=(gpu,))
    state.workers["0002"].state, state.workers["0002"].drained_by_its_step = S.DRAINING, True
    observed = tuple(ObservedStep(w.worker_id, w.step_id, w.node, w.job_id) for w in state.workers.values())
    result = tick(Observation(steps=observed), state, TickConfig(reconcile=ReconcileConfig(), gpus_per_worker=1),
                  (own, burst), 0.0)
    assert state.workers["0003"].state is S.DRAINING  # the job is ending: its other worker drains
    assert not [a for a in result.actions if isinstance(a, Launch) and a.job_id == 9]


def test_the_burst_manager_hears_of_a_job_ending_from_its_first_drained_worker(tmp_path: Path) -> None:
    """The controller's inputs to the burst decision name the job as ending from that heartbeat on
    (the manager keeps it for good: no worker is placed there again once its drained ones have
    left, which a preempted job's new workers were, killed mid-rollout); and before the job's time
    limit, the target it gets is the tick's 0, not the one kept for a raised limit."""
    from slurm_elastic.core.tick import TickResult

    config = parse_config({"agent": {"enabled": False}, "burst": {"max_jobs": 1, "gpus_per_job": 2}})
    ctl = Controller(config, 7, ListedSteps(), tmp_path / "state", gpus_by_node={"a1": (0,)})  # type: ignore[arg-type]
    ctl.state.workers["0002"] = Worker("0002", state=S.DRAINING, job_id=19, step_id="0", node="b1", gpus=(0,),
                                       drained_by_its_step=True)
    ctl.state.workers["0003"] = Worker("0003", state=S.ACTIVE, job_id=19, step_id="1", node="b1", gpus=(1,))
    ctl.state.target_workers = 3
    inputs = ctl.burst_inputs(TickResult(desired=3), {19: {"b1": (0, 1)}}, 10.0)
    assert inputs["ending_jobs"] == {19} and inputs["target_workers"] == 3
    assert ctl.burst_inputs(TickResult(desired=0), {19: {"b1": (0, 1)}}, 11.0)["target_workers"] == 0


def test_a_burst_worker_that_drained_within_one_tick_still_marks_its_job_as_ending(tmp_path: Path) -> None:
    """Seen on the dev cluster (`scancel --signal=USR1 BURSTJOB`): the workers drained at once, the
    tick after their heartbeat found their steps gone (INACTIVE), and the next placed two new
    workers into the job the signal said was ending."""
    from slurm_elastic.core.tick import TickResult

    config = parse_config({"agent": {"enabled": False}, "burst": {"max_jobs": 1, "gpus_per_job": 2}})
    ctl = Controller(config, 7, ListedSteps(), tmp_path / "state", gpus_by_node={"a1": (0,)})  # type: ignore[arg-type]
    drained = Worker("0002", state=S.INACTIVE, job_id=19, node="b1", gpus=(0,), drained_by_its_step=True)
    drained.history.append((9.5, "DRAINING", "INACTIVE", "step ended after drain"))
    ctl.state.workers["0002"] = drained
    assert ctl.burst_inputs(TickResult(desired=3), {19: {"b1": (0, 1)}}, 10.0)["ending_jobs"] == {19}
    assert ctl.burst_inputs(TickResult(desired=3), {19: {"b1": (0, 1)}}, 100.0)["ending_jobs"] == set()  # long ago
