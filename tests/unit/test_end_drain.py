"""Before the job's time limit every worker drains (each finishes its rollout and hands it over)
and none is launched; a raised limit brings them back. The controller in process on the recorded
listing (tests/unit/test_controller_replay.py), the job's start and end as Slurm gives them."""

from __future__ import annotations

import time
from pathlib import Path

from slurm_elastic.core.lifecycle import WorkerState
from slurm_elastic.slurm.parse import parse_jobs_json
from slurm_elastic.slurm.scontrol_job import job_info_from_scontrol
from slurm_elastic.status_view import render_status
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
    assert "a quarter of the job's 200 s" in controller.state.last_decision["reason"]


def test_the_jobs_start_and_time_limit_are_read_from_slurm() -> None:
    job = parse_jobs_json((DATA / "squeue_job_22.05.json").read_text())[0]
    assert (job.start_time_s, job.end_time_s) == (1795356660, 0)  # unlimited ("end_time": a year on): none
    unlimited = job_info_from_scontrol((DATA / "scontrol_job_two_nodes_22.05.txt").read_text())
    assert unlimited.start_time_s > 0 and unlimited.end_time_s == 0  # EndTime=Unknown: no drain
