"""The reconcile step, table by table: adopt, launch, drain, kill, crash backoff, placement."""

from __future__ import annotations

from slurm_elastic.core.lifecycle import Worker, WorkerState, begin_drain
from slurm_elastic.core.reconcile import (
    CANCELLED_BY_SOMEONE_ELSE,
    Cancel,
    Crashed,
    Drain,
    Launch,
    ObservedStep,
    ReconcileConfig,
    backoff_s,
    end_earlier_run,
    move_clocks_on,
    reconcile,
)
from slurm_elastic.core.speed import SLOW_FACTOR, note_busy_s, seconds_per_rollout, slow_workers

S = WorkerState
CFG = ReconcileConfig(drain_timeout_s=30, heartbeat_grace_s=10, start_timeout_s=20, backoff_base_s=2,
                      backoff_max_s=16)
NONE: frozenset[tuple[str, int]] = frozenset()


def run(workers: dict[str, Worker], observed: list[ObservedStep] | None, desired: int, now_s: float,
        slots: int = 8, cordoned: frozenset[tuple[str, int]] = NONE, exclude: tuple[str, ...] = (),
        next_number: int = 1):  # type: ignore[no-untyped-def]
    return reconcile(workers, observed, desired, slots, exclude, cordoned, CFG, now_s, next_number)


def active(worker_id: str, step_id: str, now_s: float = 0.0, node: str = "node1", gpu: int = 0,
           busy: bool = False) -> Worker:
    return Worker(worker_id, state=S.ACTIVE, step_id=step_id, node=node, gpus=(gpu,), launched_at_s=now_s,
                  last_heartbeat_s=now_s, busy=busy)


def obs(*workers: Worker) -> list[ObservedStep]:
    return [ObservedStep(w.worker_id, w.step_id, w.node) for w in workers]


def test_scale_up_from_zero_launches_new_ids() -> None:
    workers: dict[str, Worker] = {}
    plan = run(workers, [], 3, now_s=0)
    assert [a for a in plan.actions if isinstance(a, Launch)] == [Launch(i, ()) for i in ("0001", "0002", "0003")]
    assert all(w.state is S.STARTING for w in workers.values()) and plan.next_number == 4


def test_launches_are_capped_by_free_gpu_slots() -> None:
    workers = {"0001": active("0001", "1")}
    plan = run(workers, obs(workers["0001"]), 6, now_s=0, slots=3)
    assert len(plan.actions) == 2  # 3 slots, one held


def test_pending_launch_is_not_relaunched_or_failed_before_start_timeout() -> None:
    workers: dict[str, Worker] = {}
    run(workers, [], 1, now_s=0)
    plan = run(workers, [], 1, now_s=5)
    assert plan.actions == [] and workers["0001"].state is S.STARTING


def test_launch_that_never_appears_fails_into_backoff() -> None:
    workers: dict[str, Worker] = {}
    run(workers, [], 1, now_s=0)
    plan = run(workers, [], 1, now_s=25)
    assert workers["0001"].state is S.BACKOFF and plan.crashes[0].reason == "step never appeared in Slurm"


def test_scale_down_drains_idle_newest_first_and_never_twice() -> None:
    workers = {
        "0001": active("0001", "1", now_s=0, busy=True),
        "0002": active("0002", "2", now_s=1),
        "0003": active("0003", "3", now_s=2, busy=True),
        "0004": active("0004", "4", now_s=3),
    }
    plan = run(workers, obs(*workers.values()), 2, now_s=4)
    assert plan.actions == [Drain("0004", "4"), Drain("0002", "2")]
    assert workers["0004"].state is S.DRAINING
    again = run(workers, obs(*workers.values()), 2, now_s=5)
    assert again.actions == []  # draining workers are not capacity and are not drained again


def test_scale_down_drains_a_clearly_slow_worker_first_even_when_busy() -> None:
    speeds = {"0001": (10, 95.0), "0002": (10, 100.0), "0003": (10, 105.0), "0004": (8, 160.0), "0005": (2, 80.0)}
    workers = {w: active(w, w[-1], now_s=int(w), busy=w in ("0003", "0004")) for w in speeds}
    for worker_id, (rollouts, busy_s) in speeds.items():
        workers[worker_id].rollouts, workers[worker_id].busy_s = rollouts, busy_s
    # 0004: 160 s / 9 rollouts (one in flight) = 17.8 s each against a median of 10 s: drained first,
    # busy as it is; then the usual order (0005 has too few rollouts to say, and is idle and newest)
    plan = run(workers, obs(*workers.values()), 3, now_s=9)
    assert plan.actions == [Drain("0004", "4"), Drain("0005", "5")]


def test_no_worker_is_slow_before_three_are_measured_or_within_the_factor() -> None:
    a, b, c = active("0001", "1"), active("0002", "2"), active("0003", "3")
    for worker, busy_s in ((a, 40.0), (b, 40.0 * SLOW_FACTOR), (c, 200.0)):
        worker.rollouts, worker.busy_s = 4, busy_s
    assert slow_workers([a, c]) == {}  # two measured say nothing
    assert slow_workers([a, b, c]) == {"0003": 50.0}  # b is at the factor, not over it
    c.state = S.DRAINING
    assert slow_workers([a, b, c]) == {}


def test_time_stopped_inside_a_rollout_is_not_its_speed() -> None:
    """An operator's audit: after ``scontrol suspend`` for 22 s, worker 0015 (1.0 s a rollout, busy
    when its job was stopped) read 1.8 s "(slow)", still 1.4 a minute later, and drained first:
    its SDK's clock ran on while it was stopped. Its other heartbeats measure it as it is."""
    workers = [active(w, w[-1]) for w in ("0015", "0016", "0017")]
    for worker in workers:
        for second in range(5, 30, 5):  # 1 s a rollout, a heartbeat every 5 s
            worker.rollouts = second
            note_busy_s(worker, float(second), running_s=5.0)
    stopped, idle, other = workers
    note_busy_s(idle, 30.0, running_s=5.0, stopped_s=22.0)  # at the gate while stopped: nothing to take off
    note_busy_s(other, 30.0, running_s=5.0)
    note_busy_s(stopped, 30.0 + 22.0, running_s=5.0, stopped_s=22.0)  # inside a rollout while stopped
    for worker in workers:
        worker.rollouts, worker.busy = 29, True
    assert stopped.paused_busy_s == 22.0 and idle.paused_busy_s == 0.0
    assert seconds_per_rollout(stopped) == seconds_per_rollout(other) == 1.0  # unchanged: 52 / 30 = 1.7 read slow
    for second in range(35, 95, 5):  # a minute later: still as fast as the others
        for worker in workers:
            note_busy_s(worker, worker.busy_s + 5.0, running_s=5.0)
            worker.rollouts, worker.last_heartbeat_s = second - 1, float(second)
    assert seconds_per_rollout(stopped) == 1.0 and slow_workers(workers) == {}
    plan = run({w.worker_id: w for w in workers}, obs(*workers), 2, now_s=95)
    assert plan.actions == [Drain("0017", "7")]  # newest first, as any busy worker: 0015 is not slow


def test_a_stopped_workers_credit_is_what_its_count_ran_past_the_time_it_ran() -> None:
    worker = active("0001", "1")
    note_busy_s(worker, 10.0)
    note_busy_s(worker, 10.0 + 3.0 + 20.0, running_s=5.0, stopped_s=20.0)  # busy 3 s of 5, and while stopped
    assert worker.paused_busy_s == 18.0  # its 2 s idle hide as much of its stop: at most a heartbeat's worth
    note_busy_s(worker, 40.0, running_s=5.0, stopped_s=5.0)  # a count past the time: only the stop comes off
    assert worker.paused_busy_s == 18.0 + 2.0
    note_busy_s(worker, 4.0, running_s=5.0)  # its SDK counts from 0 again: so does its stopped time
    assert worker.busy_s == 4.0 and worker.paused_busy_s == 0.0


def test_a_relaunched_worker_measures_its_new_step_only() -> None:
    workers = {"0001": active("0001", "1")}
    worker = workers["0001"]
    worker.rollouts, worker.busy_s, worker.paused_busy_s, worker.exit_code = 20, 42.0, 22.0, 1
    run(workers, [], 1, now_s=10)  # it crashed: backoff, then its relaunch
    plan = run(workers, [], 1, now_s=12)
    assert plan.actions == [Launch("0001", ())]
    assert (worker.rollouts, worker.busy_s, worker.paused_busy_s) == (0, 0.0, 0.0)


def test_drained_step_that_ends_becomes_inactive() -> None:
    workers = {"0001": active("0001", "1")}
    run(workers, obs(workers["0001"]), 0, now_s=1)
    assert workers["0001"].state is S.DRAINING
    run(workers, [], 0, now_s=2)
    assert workers["0001"].state is S.INACTIVE and workers["0001"].crash_count == 0


def test_drain_timeout_cancels_once_then_resends() -> None:
    workers = {"0001": active("0001", "1")}
    observed = obs(workers["0001"])
    run(workers, observed, 0, now_s=0)
    workers["0001"].last_heartbeat_s = 100
    assert run(workers, observed, 0, now_s=29).actions == []
    assert run(workers, observed, 0, now_s=30).actions == [Cancel("0001", "1", "drain timeout 30 s reached")]
    assert run(workers, observed, 0, now_s=31).actions == []
    assert len(run(workers, observed, 0, now_s=61).actions) == 1
    run(workers, [], 0, now_s=62)  # its step ends: cancelled, not drained (it said "step ended after drain")
    assert workers["0001"].state is S.INACTIVE and workers["0001"].crash_count == 0
    assert workers["0001"].history[-1][3] == "step cancelled at the drain timeout (30 s)"


def test_unexpected_exit_crashes_with_exponential_backoff_and_same_id_relaunch() -> None:
    workers = {"0001": active("0001", "1", gpu=2)}
    workers["0001"].exit_code = 1
    plan = run(workers, [], 1, now_s=10)
    assert workers["0001"].state is S.BACKOFF and plan.crashes[0].gpus == (2,)
    assert plan.actions == []  # backing off: no relaunch and no fresh worker in its place
    plan = run(workers, [], 1, now_s=12)
    assert plan.actions == [Launch("0001", ())] and workers["0001"].launches == 1
    assert [backoff_s(n, CFG) for n in (1, 2, 3, 4, 5, 6)] == [2, 4, 8, 16, 16, 16]


def test_a_step_gone_without_an_exit_waits_for_slurms_word_before_it_counts_as_a_crash() -> None:
    workers = {"0001": active("0001", "1", gpu=2)}
    plan = run(workers, [], 1, now_s=10)  # no exit reported: the CANCELLED line may still be on its way
    assert workers["0001"].state is S.ACTIVE and plan.crashes == [] and plan.actions == []
    assert workers["0001"].vanished_at_s == 10
    plan = reconcile(workers, [], 1, 8, (), NONE, CFG, 11, 1, cancelled=frozenset({"0001"}))
    assert [c.counted for c in plan.crashes] == [False] and workers["0001"].vanished_at_s == 0
    workers = {"0002": active("0002", "2")}
    run(workers, [], 1, now_s=10)
    plan = run(workers, [], 1, now_s=10 + CFG.step_end_settle_s)  # nothing came: a crash
    assert workers["0002"].state is S.BACKOFF and plan.crashes[0].reason == "step ended unexpectedly"
    assert workers["0002"].crash_count == 1 and workers["0002"].vanished_at_s == 0


def test_clean_exit_is_not_a_crash() -> None:
    workers = {"0001": active("0001", "1")}
    workers["0001"].exit_code = 0
    plan = run(workers, [], 0, now_s=1)
    assert workers["0001"].state is S.INACTIVE and plan.crashes == []


def test_a_step_someone_else_cancelled_is_relaunched_at_once_and_not_counted_against_its_gpu() -> None:
    workers = {"0001": active("0001", "1", gpu=2)}
    plan = reconcile(workers, [], 1, 8, (), NONE, CFG, 10, 1, cancelled=frozenset({"0001"}))
    assert plan.crashes == [Crashed("0001", "node1", (2,), CANCELLED_BY_SOMEONE_ELSE, (("node1", 2),), counted=False)]
    assert plan.actions == [Launch("0001", ())]  # in the same tick: no backoff
    assert workers["0001"].state is S.STARTING and workers["0001"].crash_count == 0


def test_a_worker_the_controller_cancelled_for_cause_still_counts() -> None:
    workers = {"0001": active("0001", "1", now_s=0)}
    run(workers, obs(workers["0001"]), 1, now_s=11)  # no heartbeat: cancelled for cause
    plan = reconcile(workers, [], 1, 8, (), NONE, CFG, 12, 1, cancelled=frozenset({"0001"}))
    assert plan.crashes[0].counted and workers["0001"].crash_count == 1


def test_lost_heartbeat_kills_and_counts_as_crash() -> None:
    workers = {"0001": active("0001", "1", now_s=0)}
    observed = obs(workers["0001"])
    plan = run(workers, observed, 1, now_s=11)
    assert plan.actions[0] == Cancel("0001", "1", "no heartbeat for 11 s (grace 10 s)")
    plan = run(workers, [], 1, now_s=12)
    assert workers["0001"].state is S.BACKOFF and "no heartbeat" in plan.crashes[0].reason


def test_a_pause_of_the_controller_moves_heartbeat_start_and_drain_clocks_on() -> None:
    workers = {"0001": active("0001", "1", now_s=0), "0002": active("0002", "2", now_s=0),
               "0003": Worker("0003", state=S.STARTING, launched_at_s=0, last_heartbeat_s=0)}
    begin_drain(workers["0002"], 0, "scale-down")
    observed = obs(workers["0001"], workers["0002"])  # 0003 launched, not listed yet

    move_clocks_on(workers, 40, now_s=45)  # the controller did not run from 5 s to 45 s

    assert run(workers, observed, 2, now_s=45).actions == []  # nobody taken for hung, timed out or never started
    assert [workers[w].state for w in ("0001", "0002", "0003")] == [S.ACTIVE, S.DRAINING, S.STARTING]
    assert run(workers, observed, 2, now_s=51).actions == [Cancel("0001", "1", "no heartbeat for 11 s (grace 10 s)")]


def test_a_requeue_ends_the_earlier_runs_workers_without_a_crash() -> None:
    workers = {"0001": active("0001", "1"), "0002": Worker("0002", state=S.BACKOFF, crash_count=1),
               "0003": active("0003", "0")}
    workers["0003"].job_id = 99  # in a burst job: left to the listing
    assert end_earlier_run(workers, 17, now_s=5) == ["0001"]
    assert workers["0001"].state is S.INACTIVE and workers["0001"].crash_count == 0 and not workers["0001"].step_id

    plan = run(workers, [ObservedStep("0003", "0", "node1", 99)], 2, now_s=6)

    assert plan.crashes == [] and [a for a in plan.actions if isinstance(a, Launch)] == [Launch("0002", ())]
    assert workers["0002"].state is S.STARTING and workers["0003"].state is S.ACTIVE


def test_restart_adopts_running_steps_without_relaunching() -> None:
    workers: dict[str, Worker] = {}
    observed = [ObservedStep("0003", "7", "node2"), ObservedStep("0009", "8", "node1")]
    plan = run(workers, observed, 2, now_s=100)
    assert plan.actions == [] and set(workers) == {"0003", "0009"}
    assert plan.next_number == 10  # new ids never collide with adopted ones
    assert workers["0003"].launches == 1  # its step was launched once: a relaunch is its second


def test_restart_keeps_draining_workers_draining() -> None:
    worker = active("0001", "1", now_s=0)
    workers = {"0001": worker}
    run(workers, obs(worker), 0, now_s=1)
    restored = {k: Worker.from_json(v.to_json()) for k, v in workers.items()}  # as from the state file
    plan = run(restored, obs(worker), 0, now_s=2)
    assert restored["0001"].state is S.DRAINING and plan.actions == []


def test_failed_listing_changes_nothing() -> None:
    workers = {"0001": active("0001", "1")}
    plan = run(workers, None, 5, now_s=1000)
    assert plan.actions == [] and workers["0001"].state is S.ACTIVE


def test_workers_on_cordoned_gpus_do_not_hold_allowed_slots() -> None:
    workers = {"0001": active("0001", "1", gpu=0)}
    plan = run(workers, obs(workers["0001"]), 3, now_s=1, slots=2, cordoned=frozenset({("node1", 0)}),
               exclude=("node9",))
    assert plan.actions == [Launch("0002", ("node9",)), Launch("0003", ("node9",))]


def test_placeholder_is_not_capacity_and_is_released_on_uncordon() -> None:
    holder = active("0001", "1", gpu=3)
    holder.placeholder = True
    workers = {"0001": holder}
    plan = run(workers, obs(holder), 1, now_s=1, cordoned=frozenset({("node1", 3)}))
    assert plan.actions == [Launch("0002", ())]
    plan = run(workers, obs(holder, workers["0002"]), 1, now_s=2)
    assert Cancel("0001", "1", "GPU uncordoned: releasing placeholder") in plan.actions


def test_workers_launched_in_the_same_tick_drain_newest_id_first() -> None:
    workers = {f"000{i}": active(f"000{i}", str(i), now_s=5) for i in range(1, 6)}
    plan = run(workers, obs(*workers.values()), 2, now_s=6)
    assert [a.worker_id for a in plan.actions] == ["0005", "0004", "0003"]
