"""The core tick on its own: capacity as allocations, actions carrying the job of each step."""

from __future__ import annotations

from slurm_elastic.core.autoscaler_config import AutoscalerConfig
from slurm_elastic.core.cordons import CordonBook
from slurm_elastic.core.health import GpuSample
from slurm_elastic.core.lifecycle import Worker, WorkerState
from slurm_elastic.core.placement import Allocation, placement
from slurm_elastic.core.pressure import QueueSnapshot
from slurm_elastic.core.reconcile import Cancel, Drain, Launch, ObservedStep, ReconcileConfig
from slurm_elastic.core.scaling import Autoscaler, Decision, PressureInputs
from slurm_elastic.core.tick import ControlState, Observation, TickConfig, tick

S = WorkerState
OWN = Allocation(7, {"a1": (0, 1)})
OTHER = Allocation(9, {"b1": (0, 1, 2)})
CFG = TickConfig(reconcile=ReconcileConfig(), gpus_per_worker=1)


def state(target: int) -> ControlState:
    return ControlState(autoscaler=Autoscaler(AutoscalerConfig(enabled=False)), cordons=CordonBook(),
                        target_workers=target)


def test_placement_counts_slots_per_allocation_and_excludes_full_nodes() -> None:
    slots = placement((OWN, OTHER), 1, {("a1", 0), ("a1", 1)}, foreign_gpus={9: {"b1": 1}})
    assert [(s.job_id, s.slots, s.exclude_nodes) for s in slots] == [(7, 0, ("a1",)), (9, 2, ())]


def test_a_cordoned_gpu_no_worker_holds_is_taken_for_the_trainers_first() -> None:
    """Slurm counts the trainer's GPUs, it does not name them: a cordon on the trainer's GPU (one no
    step of the pool holds) must not take a second GPU off the slots (found by an operator's probe:
    a healthy GPU stayed empty)."""
    node = Allocation(7, {"n1": (0, 1, 2, 3)})
    trainer = {7: {"n1": 1}}
    assert placement((node,), 1, set(), foreign_gpus=trainer)[0].slots == 3
    assert placement((node,), 1, {("n1", 0)}, foreign_gpus=trainer)[0].slots == 3
    assert placement((node,), 1, {("n1", 0), ("n1", 1)}, foreign_gpus=trainer, own_gpus={("n1", 1)})[0].slots == 2
    held_by_ours = placement((node,), 1, {("n1", 0)}, foreign_gpus=trainer, own_gpus={("n1", 0)})
    assert held_by_ours[0].slots == 2  # a placeholder holds the cordoned GPU: the trainer is elsewhere


def test_with_the_trainers_gpu_cordoned_the_tick_launches_on_every_other_one() -> None:
    node = Allocation(7, {"n1": (0, 1, 2, 3)})
    st = state(3)
    st.cordons.cordon_manual("n1", 0, "the trainer's GPU reports faults", 0.0)
    result = tick(Observation(steps=(), foreign_gpus={7: {"n1": 1}}), st, CFG, (node,), 0.0)
    assert sum(isinstance(a, Launch) for a in result.actions) == 3 and result.slots[0].slots == 3


def test_launches_fill_the_first_allocation_then_the_next() -> None:
    st = state(4)
    result = tick(Observation(steps=()), st, CFG, (OWN, OTHER), 0.0)
    launches = [a for a in result.actions if isinstance(a, Launch)]
    assert [(a.worker_id, a.job_id) for a in launches] == [("0001", 7), ("0002", 7), ("0003", 9), ("0004", 9)]
    assert [st.workers[w].job_id for w in ("0001", "0003")] == [7, 9]


def test_signals_and_cancels_carry_the_job_of_the_workers_step() -> None:
    st = state(0)
    st.workers["0001"] = Worker("0001", state=S.ACTIVE, job_id=9, step_id="4", node="b1", gpus=(0,))
    st.workers["0002"] = Worker("0002", state=S.ACTIVE, job_id=0, step_id="5", node="a1", gpus=(0,),
                                last_heartbeat_s=-100.0)
    observed = (ObservedStep("0001", "4", "b1", 9), ObservedStep("0002", "5", "a1", 7))
    result = tick(Observation(steps=observed), st, CFG, (OWN, OTHER), 0.0)
    assert Cancel("0002", "5", "no heartbeat for 100 s (grace 60 s)", 0) in result.actions
    assert Drain("0001", "4", 9) in result.actions


def test_a_server_gets_its_drain_signal_once_nothing_is_in_flight_and_the_grace_is_over() -> None:
    cfg = TickConfig(reconcile=ReconcileConfig(), gpus_per_worker=1, is_server=True, server_drain_grace_s=1.0)
    st = state(0)
    st.workers["0001"] = Worker("0001", state=S.ACTIVE, step_id="4", node="a1", gpus=(0,))
    obs = Observation(steps=(ObservedStep("0001", "4", "a1"),), outstanding_by_worker={"0001": 2})
    assert tick(obs, st, cfg, (OWN,), 0.0).actions == []
    assert st.workers["0001"].state is S.DRAINING  # out of discovery at once
    assert tick(obs, st, cfg, (OWN,), 5.0).actions == []  # requests in flight there
    idle = Observation(steps=obs.steps, outstanding_by_worker={"0001": 0})
    assert tick(idle, st, cfg, (OWN,), 6.0).actions == [Drain("0001", "4", 0)]
    assert tick(idle, st, cfg, (OWN,), 7.0).actions == []  # once


def test_after_a_restart_a_draining_server_waits_the_grace_again_for_the_routers_reports() -> None:
    """Found by a live audit: a restarted controller read "no report yet" as nothing in flight, and
    the drain's grace had long passed, so it signalled a server with 2 requests running."""
    cfg = TickConfig(reconcile=ReconcileConfig(), gpus_per_worker=1, is_server=True, server_drain_grace_s=1.0)
    st = state(0)
    st.workers["0001"] = Worker("0001", state=S.DRAINING, step_id="4", node="a1", gpus=(0,), drain_started_s=0.0)
    st.started_s = 100.0
    no_report = Observation(steps=(ObservedStep("0001", "4", "a1"),))
    assert tick(no_report, st, cfg, (OWN,), 100.2).actions == []
    assert tick(no_report, st, cfg, (OWN,), 101.0).actions == [Drain("0001", "4", 0)]


def test_a_policy_in_the_autoscalers_seat_decides_the_count_from_the_autoscalers_inputs() -> None:
    seen: list[PressureInputs] = []

    class Fixed:
        def decide(self, x: PressureInputs, now_s: float) -> Decision:
            seen.append(x)
            return Decision(3, "scale_up", "fixed")

    st = ControlState(autoscaler=Autoscaler(AutoscalerConfig()), cordons=CordonBook(), policy=Fixed())
    result = tick(Observation(steps=()), st, CFG, (OWN, OTHER), 0.0)
    assert result.desired == 3 and len([a for a in result.actions if isinstance(a, Launch)]) == 3
    assert seen[0].allowed_slots == 5 and st.last_decision["reason"] == "fixed"


def test_a_scale_down_drains_burst_workers_first_and_a_released_job_is_emptied() -> None:
    st = state(2)
    for wid, job, node, gpu in (("0001", 7, "a1", 0), ("0002", 7, "a1", 1), ("0003", 9, "b1", 0)):
        st.workers[wid] = Worker(wid, state=S.ACTIVE, job_id=job, step_id=wid[-1], node=node, gpus=(gpu,), busy=True)
    observed = tuple(ObservedStep(w.worker_id, w.step_id, w.node, w.job_id) for w in st.workers.values())
    result = tick(Observation(steps=observed), st, CFG, (OWN, OTHER), 0.0)
    assert [a for a in result.actions if isinstance(a, Drain)] == [Drain("0003", "3", 9)]  # the burst job's first
    st = state(3)
    st.workers = {w.worker_id: Worker(w.worker_id, state=S.ACTIVE, job_id=w.job_id, step_id=w.step_id, node=w.node,
                                      gpus=w.gpus) for w in (Worker("0001", job_id=7, step_id="1", node="a1", gpus=(0,)),
                                                             Worker("0003", job_id=9, step_id="3", node="b1", gpus=(0,)))}
    released = Observation(steps=(ObservedStep("0001", "1", "a1", 7), ObservedStep("0003", "3", "b1", 9)),
                           releasing_jobs=frozenset({9}))
    result = tick(released, st, CFG, (OWN,), 0.0)  # job 9 is given back: no longer an allocation
    assert Drain("0003", "3", 9) in result.actions and st.workers["0003"].state is S.DRAINING
    assert not [a for a in result.actions if isinstance(a, Launch) and a.job_id == 9]  # nothing new goes there


def test_the_count_may_reach_for_slots_burst_jobs_could_add() -> None:
    st = state(0)
    st.wake_all_active = True  # every allowed slot: the allocation's, and what burst jobs could add
    assert tick(Observation(steps=()), st, CFG, (OWN,), 0.0).desired == 2
    more = tick(Observation(steps=(), burst_slots_possible=4), st, CFG, (OWN,), 1.0)
    assert more.desired == 6 and not [a for a in more.actions if isinstance(a, Launch)]  # no slot for more yet


def test_the_autoscaler_sees_the_burst_slots_and_the_workers_still_loading() -> None:
    seen: list[PressureInputs] = []

    class Spy:
        def decide(self, x: PressureInputs, now_s: float) -> Decision:
            seen.append(x)
            return Decision(4, "hold", "spy")

    st = ControlState(autoscaler=Autoscaler(AutoscalerConfig()), cordons=CordonBook(), policy=Spy())
    for wid, worker_state, rollouts, busy in (("0001", S.STARTING, 0, False), ("0002", S.ACTIVE, 0, False),
                                              ("0003", S.ACTIVE, 0, True), ("0004", S.ACTIVE, 3, False)):
        st.workers[wid] = Worker(wid, state=worker_state, job_id=7, rollouts=rollouts, busy=busy)
    queue = QueueSnapshot(queued_seqs=0, batch_size=32, consumption_seqs_per_s=None, production_seqs_per_s=None,
                          in_flight_seqs=0, max_staleness=2, staleness_capacity_seqs=96, buffer_capacity_seqs=512)
    tick(Observation(steps=None, queue=queue, busy_worker_s=30.0, burst_slots_possible=4), st, CFG, (OWN,), 0.0)
    # starting, and active without a rollout started; not the one inside its first rollout
    assert (seen[-1].workers_loading, seen[-1].burst_slots, seen[-1].allowed_slots) == (2, 4, 6)
    tick(Observation(steps=None, queue=queue, busy_worker_s=None), st, CFG, (OWN,), 1.0)
    assert seen[-1].workers_loading == 0  # workers that report no busy time: loading is not known


def test_wake_all_fills_every_allowed_gpu_beside_a_worker_kept_on_a_cordoned_one() -> None:
    st = state(0)
    st.workers["0001"] = Worker("0001", state=S.ACTIVE, job_id=7, step_id="1", node="a1", gpus=(0,))
    st.cordons.cordon_manual("a1", 0, "operator", 0.0)  # an operator's cordon keeps its worker running
    st.wake_all_active = True
    result = tick(Observation(steps=(ObservedStep("0001", "1", "a1", 7),)), st, CFG, (OWN,), 0.0)
    assert result.desired == 2 and "kept on cordoned GPUs" in st.last_decision["reason"]
    assert [a.worker_id for a in result.actions if isinstance(a, Launch)] == ["0002"]  # a1:1 gets one


def test_a_worker_kept_on_a_cordoned_gpu_does_not_cost_the_autoscaler_another_gpu() -> None:
    seen: list[PressureInputs] = []

    class Wants:
        def decide(self, x: PressureInputs, now_s: float) -> Decision:
            seen.append(x)
            return Decision(min(x.allowed_slots, self.count), "scale_up", "wants more")

        count = 3

    own = Allocation(7, {"a1": (0, 1, 2)})
    st = ControlState(autoscaler=Autoscaler(AutoscalerConfig()), cordons=CordonBook(), policy=Wants())
    for wid, gpu in (("0001", 0), ("0002", 1), ("0003", 2)):
        st.workers[wid] = Worker(wid, state=S.ACTIVE, job_id=7, step_id=wid[-1], node="a1", gpus=(gpu,), busy=True)
    observed = tuple(ObservedStep(w.worker_id, w.step_id, "a1", 7) for w in st.workers.values())
    st.cordons.cordon_manual("a1", 0, "operator", 0.0)  # a cordon does not drain: 0001 runs on
    result = tick(Observation(steps=observed), st, CFG, (own,), 0.0)
    # two allowed GPUs, both held, and one kept on the cordoned GPU: three, none drained, none launched
    assert seen[-1].allowed_slots == 3 and result.desired == 3 and result.actions == []
    Wants.count = 2  # a scale-down: the worker on the cordoned GPU is the one drained
    result = tick(Observation(steps=observed), st, CFG, (own,), 1.0)
    assert result.actions == [Drain("0001", "1", 7)]


def test_a_failing_policy_holds_the_count_and_the_tick_still_replaces_a_silent_worker() -> None:
    class Broken:
        def decide(self, x: PressureInputs, now_s: float) -> Decision:
            raise ZeroDivisionError("float division by zero")

    st = ControlState(autoscaler=Autoscaler(AutoscalerConfig()), cordons=CordonBook(), policy=Broken(),
                      target_workers=1)
    st.workers["0001"] = Worker("0001", state=S.ACTIVE, job_id=7, step_id="1", node="a1", gpus=(0,),
                                last_heartbeat_s=-100.0)
    result = tick(Observation(steps=(ObservedStep("0001", "1", "a1", 7),)), st, CFG, (OWN,), 0.0)
    assert result.desired == 1 and st.last_decision["error"] == "ZeroDivisionError: float division by zero"
    assert "the autoscaler failed" in st.last_decision["reason"]
    assert Cancel("0001", "1", "no heartbeat for 100 s (grace 60 s)", 7) in result.actions


def test_nothing_new_goes_to_a_burst_job_a_worker_left_on_its_own() -> None:
    """A burst worker's exit 0 (Slurm's drain signal at a preemption or the time limit) marks its
    job as ending in the same tick: its replacement goes elsewhere, never into that job (it did, for
    one rollout, before the controller marked the job after the tick), and its other workers drain."""
    st = state(3)
    for wid, job, node, gpu in (("0001", 7, "a1", 0), ("0002", 9, "b1", 0), ("0003", 9, "b1", 1)):
        st.workers[wid] = Worker(wid, state=S.ACTIVE, job_id=job, step_id=wid[-1], node=node, gpus=(gpu,))
    st.workers["0002"].exit_code = 0  # it left on its own: its step is gone
    observed = (ObservedStep("0001", "1", "a1", 7), ObservedStep("0003", "3", "b1", 9))
    result = tick(Observation(steps=observed), st, CFG, (OWN, OTHER), 0.0)
    assert not [a for a in result.actions if isinstance(a, Launch) and a.job_id == 9], result.actions
    assert Drain("0003", "3", 9) in result.actions
    assert st.workers["0002"].state is S.INACTIVE and st.workers["0002"].history[-1][3] == "exited cleanly"


def test_gpus_whose_agent_has_yet_to_report_count_for_the_target_but_get_no_worker() -> None:
    """With agents on, no GPU takes a worker before its node's agent reports; deciding the count on
    the slots without them dropped `workers.initial_workers` to zero at the first tick (seen on a
    real GPU node), and would give back a burst job whose agent had not reported yet."""
    cfg = TickConfig(reconcile=ReconcileConfig(), gpus_per_worker=1, agents=True)
    scaler = AutoscalerConfig(min_workers=0, max_workers=5)
    st = ControlState(autoscaler=Autoscaler(scaler), cordons=CordonBook(), target_workers=2)

    first = tick(Observation(steps=()), st, cfg, (OWN, OTHER), 0.0)
    assert first.desired == 2 and not [a for a in first.actions if isinstance(a, Launch)]
    assert [s.slots for s in first.slots] == [0, 0] and first.slots_once_heard == (2, 3)
    st.cordons.observe([GpuSample("a1", gpu, temperature_c=40.0, memory_used_mb=0, memory_total_mb=1000)
                        for gpu in (0, 1)], 5.0)
    heard = tick(Observation(steps=()), st, cfg, (OWN, OTHER), 6.0)
    assert [a.worker_id for a in heard.actions if isinstance(a, Launch)] == ["0001", "0002"]
    assert [s.slots for s in heard.slots] == [2, 0] and heard.slots_once_heard == (2, 3)

    silent = ControlState(autoscaler=Autoscaler(scaler), cordons=CordonBook(), target_workers=2)
    tick(Observation(steps=()), silent, cfg, (OWN,), 0.0)  # launches the agent at 0 s; it never reports
    later = tick(Observation(steps=()), silent, cfg, (OWN,), silent.cordons.rules.agent_silence_s + 1.0)
    assert later.slots_once_heard == (0,) and later.desired == 0  # of unknown health now: not counted


def test_a_burst_job_that_takes_a_node_straight_after_another_awaits_its_own_agent() -> None:
    """Seen on the dev cluster: burst job B got node b1 within a tick of A's end there; b1 counted
    as heard (A's agent had reported) and took B's workers at once, while B's agent waited for A's
    (still listed) to go and for the relaunch pause: 19 s after the workers, or never."""
    from slurm_elastic.core.tick import LaunchAgent

    cfg = TickConfig(reconcile=ReconcileConfig(), gpus_per_worker=1, agents=True)
    st = ControlState(autoscaler=Autoscaler(AutoscalerConfig(min_workers=0, max_workers=5)), cordons=CordonBook(),
                      target_workers=3)
    tick(Observation(steps=()), st, cfg, (OWN, OTHER), 0.0)
    st.cordons.observe([GpuSample(n, g, temperature_c=40.0, memory_used_mb=0, memory_total_mb=1000)
                        for n, gpus in (("a1", (0, 1)), ("b1", (0, 1, 2))) for g in gpus], 1.0)
    heard = tick(Observation(steps=(), agent_nodes=frozenset({(7, "a1"), (9, "b1")})), st, cfg, (OWN, OTHER), 2.0)
    assert [s.slots for s in heard.slots] == [2, 3]
    after = Allocation(10, {"b1": (0, 1, 2)})  # B: the same node, A's agent step still listed
    taken = tick(Observation(steps=(), agent_nodes=frozenset({(7, "a1"), (9, "b1")})), st, cfg, (OWN, after), 3.0)
    assert [s.slots for s in taken.slots] == [2, 0] and taken.slots_once_heard == (2, 3)  # awaited anew
    assert [a for a in taken.actions if isinstance(a, LaunchAgent)] == [LaunchAgent(10, "b1", 3)]  # its own, now


def test_a_node_is_awaited_from_when_it_is_held_until_it_reports_or_for_agent_silence_s_at_most() -> None:
    """A node a new burst job holds again was heard before, under the old job: its agent is awaited
    all the same; and an agent that never reports (relaunched every agent_relaunch_s) keeps its
    node's GPUs counted no longer than agent_silence_s after the node was taken."""
    from slurm_elastic.core.tick import awaiting_first_reports, hold_nodes

    st = state(0)
    silence_s = st.cordons.rules.agent_silence_s

    def awaited(allocations: tuple[Allocation, ...], now_s: float) -> set[str]:
        hold_nodes(st, allocations, now_s)
        return awaiting_first_reports(st, now_s)

    assert awaited((OTHER,), 0.0) == {"b1"}  # held from 0 s, never heard
    st.cordons.observe([GpuSample("b1", 0, temperature_c=40.0)], 1.0)
    assert awaited((OTHER,), 2.0) == set()  # heard
    assert awaited((), 100.0) == set()  # the burst job ended: b1 is not held
    assert awaited((OTHER,), 500.0) == {"b1"}  # held again: its old report does not count
    st.agent_launched_s[(OTHER.job_id, "b1")] = 500.0 + silence_s  # relaunched, still silent
    assert awaited((OTHER,), 500.0 + silence_s + 1) == set()  # bounded by the hold's start
    st.cordons.observe([GpuSample("b1", 0, temperature_c=40.0)], 600.0)
    assert awaited((OTHER,), 601.0) == set()
