"""Before the job's time limit every worker drains (each finishes its rollout and hands it over)
and none is launched; a raised limit brings them back. The controller in process on the recorded
listing (tests/unit/test_controller_replay.py), the job's start and end as Slurm gives them."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from slurm_elastic.core.lifecycle import WorkerState
from slurm_elastic.slurm.parse import parse_jobs_json
from slurm_elastic.slurm.scontrol_job import job_info_from_scontrol
from slurm_elastic.status_view import render_status
from slurm_elastic.trainer import Trainer
from tests.unit.served_controller import ServedController
from tests.unit.test_controller_replay import (
    DATA,
    JOB_ID,
    RUNNING,
    Clock,
    make,
    register_all,
    step_of,
)

S = WorkerState


def test_near_the_time_limit_every_worker_drains_and_a_raised_limit_brings_them_back(tmp_path: Path) -> None:
    clock = Clock()
    controller, backend = make(tmp_path, RUNNING, clock)
    controller.tick()
    register_all(controller, RUNNING)
    assert controller.state.target_workers == 3
    controller.job_times_s = (time.time() - 3600, time.time() + 600)  # 10 minutes left: nothing yet
    controller.tick()
    assert backend.signalled == [] and controller.state.last_decision["action"] == "hold"
    controller.job_times_s = (time.time() - 3600, time.time() + 100)  # workers.end_drain_s: 120 s
    controller.tick()
    assert sorted(step for _, step, _ in backend.signalled) == sorted(step_of(w) for w in ("0001", "0002", "0003"))
    assert all(w.state is S.DRAINING and w.history[-1][3] == "the job's time limit is near"
               for w in controller.workers.values())
    reason = controller.state.last_decision["reason"]
    assert reason.startswith("the job's time limit is 100 s away: every worker drains"), reason
    text = render_status(JOB_ID, {"controller": controller.status()}, now_s=controller.clock())
    assert "target: 0 workers (draining before the job's time limit; then 3)" in text, text
    backend.steps = [s for s in RUNNING if not s.name.startswith("se-w-")]  # they drained and left
    clock.now_s += 1.0
    controller.tick()
    assert backend.launched == [] and all(w.state is S.INACTIVE for w in controller.workers.values())
    assert controller.state.target_workers == 3  # kept for a raised limit
    controller.job_times_s = (time.time() - 3600, time.time() + 3600)  # `scontrol update TimeLimit=+60`
    clock.now_s += 1.0
    controller.tick()
    assert len(backend.launched) == 3 and controller.state.last_decision["action"] == "hold"


def test_a_short_job_drains_for_a_quarter_of_its_time_at_most(tmp_path: Path) -> None:
    clock = Clock()
    controller, backend = make(tmp_path, RUNNING, clock)
    controller.tick()
    register_all(controller, RUNNING)
    controller.job_times_s = (time.time() - 140, time.time() + 60)  # a 200 s job: 50 s, not 120
    controller.tick()
    assert backend.signalled == []
    controller.job_times_s = (time.time() - 160, time.time() + 40)
    controller.tick()
    assert len(backend.signalled) == 3
    assert "capped at a quarter of the job's 200 s: 50 s" in controller.state.last_decision["reason"]


def test_the_jobs_start_and_time_limit_are_read_from_slurm() -> None:
    job = parse_jobs_json((DATA / "squeue_job_22.05.json").read_text())[0]
    assert (job.start_time_s, job.end_time_s) == (1795356660, 0)  # unlimited ("end_time": a year on): none
    unlimited = job_info_from_scontrol((DATA / "scontrol_job_two_nodes_22.05.txt").read_text())
    assert unlimited.start_time_s > 0 and unlimited.end_time_s == 0  # EndTime=Unknown: no drain


def test_a_limit_lifted_to_unlimited_mid_run_stops_the_drain(tmp_path: Path) -> None:
    """``scontrol update TimeLimit=UNLIMITED`` while the workers drain: the next allocation check reads
    no end, and the workers come back."""
    clock = Clock()
    controller, backend = make(tmp_path, RUNNING, clock)
    controller.tick()
    register_all(controller, RUNNING)
    job = parse_jobs_json((DATA / "squeue_job_22.05.json").read_text())[0]
    controller.note_job_times(replace(job, end_time_s=int(time.time()) + 100))
    controller.tick()
    assert len(backend.signalled) == 3
    backend.steps = [s for s in RUNNING if not s.name.startswith("se-w-")]
    clock.now_s += 1.0
    controller.tick()
    assert backend.launched == []
    controller.note_job_times(job)  # the same job, its limit now UNLIMITED: no end
    assert controller.job_times_s is None
    clock.now_s += 1.0
    controller.tick()
    assert len(backend.launched) == 3 and controller.state.last_decision["action"] != "drain"


def test_the_trainer_and_status_read_the_time_left(tmp_path: Path) -> None:
    """``time_limit_in_s`` in /global-status, the ``Trainer`` helper's ``time_limit_in_s()`` and the
    ``controller:`` line of ``status``; None (and nothing shown) for a job without a limit."""
    served = ServedController(tmp_path, "tok")
    trainer = Trainer(served.url, "tok")
    try:
        assert trainer.time_limit_in_s() is None
        assert "time limit" not in render_status(1, trainer.status())
        served.controller.job_times_s = (time.time() - 60, time.time() + 600)
        left = trainer.time_limit_in_s()
        assert left is not None and 595 < left <= 600
        assert "time limit in 10m" in render_status(1, trainer.status())
        served.controller.job_times_s = (time.time() - 60, time.time() - 3)  # the limit just passed
        assert "time limit in 0s" in render_status(1, trainer.status())
    finally:
        trainer.close()
        served.close()


def test_scale_and_wake_all_during_the_drain_set_the_count_to_come_back_to(tmp_path: Path) -> None:
    """Nothing is launched before a raised limit; the answer says so, and status names the
    operator's count (not the autoscaler's last) as the one to come back to."""
    clock = Clock()
    controller, backend = make(tmp_path, RUNNING, clock)
    controller.tick()
    register_all(controller, RUNNING)
    controller.job_times_s = (time.time() - 3600, time.time() + 100)
    controller.tick()
    assert len(backend.signalled) == 3
    answer = controller.scale(2)
    assert "the job's time limit is near" in answer["note"], answer
    clock.now_s += 1.0
    controller.tick()
    assert backend.launched == [] and controller.state.target_workers == 2
    text = render_status(JOB_ID, {"controller": controller.status()}, now_s=controller.clock())
    assert "target: 0 workers (draining before the job's time limit; then 2)" in text, text
    assert "the job's time limit is near" in controller.wake_all()["note"]
    assert "the job's time limit is near" in controller.pause()["note"]
    clock.now_s += 1.0
    controller.tick()
    assert backend.launched == [] and controller.state.target_workers == controller.usable_slots
    assert "the job's time limit is near" in controller.resume()["note"]
    controller.job_times_s = (time.time() - 3600, time.time() + 3600)  # raised: the autoscaler decides again
    clock.now_s += 1.0
    controller.tick()
    assert controller.state.last_decision["action"] != "drain" and backend.launched
