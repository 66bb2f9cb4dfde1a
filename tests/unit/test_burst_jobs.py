"""Burst jobs outside the core: the [burst] table, the rendered batch script, the squeue listing,
the environment of a step launched into another job, the controller watch, SIGTERM as a drain."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from slurm_elastic.controller.burst_config import time_limit_s
from slurm_elastic.controller.burst_jobs import (
    burst_policy,
    core_jobs,
    start_time_s,
    worker_slots_per_job,
)
from slurm_elastic.controller.config import BurstSection, load_config, parse_config
from slurm_elastic.errors import ConfigError, SlurmCommandError
from slurm_elastic.render import render_burst_script
from slurm_elastic.slurm.cli_backend import step_launch_environ
from slurm_elastic.slurm.parse import FIELD_SEP, QueuedJob, parse_job_lines
from slurm_elastic.worker.burst_watch import controller_answers, parent_ended, watch
from slurm_elastic.worker.wrapper import Flags, install_handlers

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).with_name("data") / "render"


def test_burst_is_off_by_default_and_bad_tables_name_the_key() -> None:
    assert parse_config({}).burst.max_jobs == 0
    cases = {
        "burst.gpus_per_job (3) must split evenly over burst.nodes_per_job (2)":
            {"burst": {"max_jobs": 1, "gpus_per_job": 3, "nodes_per_job": 2}},
        "do not hold whole workers of workers.gpus_per_worker = 2":
            {"burst": {"max_jobs": 1, "gpus_per_job": 3}, "workers": {"gpus_per_worker": 2}},
        "burst.max_jobs: burst jobs lend GPUs, but workers.gpus_per_worker is 0":
            {"burst": {"max_jobs": 1}, "workers": {"gpus_per_worker": 0}},
        "burst.extra_sbatch_options: not an sbatch option: 'x'": {"burst": {"extra_sbatch_options": ["x"]}},
        "burst.max_job: unknown key": {"burst": {"max_job": 1}},
        "burst.max_jobs: Input should be greater than or equal to 0": {"burst": {"max_jobs": -1}},
    }
    for message, data in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config(data)


@pytest.mark.parametrize(("burst", "key", "says"), [
    ({"max_jobs": -1}, "burst.max_jobs", "greater than or equal to 0"),
    ({"gpus_per_job": 0}, "burst.gpus_per_job", "greater than or equal to 1"),
    ({"extra_sbatch_options": ["--job-name=other"]}, "burst.extra_sbatch_options", "override --job-name"),
    ({"extra_sbatch_options": ["-Jother"]}, "burst.extra_sbatch_options", "override --job-name"),
    ({"extra_sbatch_options": ["--job=other"]}, "burst.extra_sbatch_options", "override --job-name"),
    ({"extra_sbatch_options": ["--comment=mine"]}, "burst.extra_sbatch_options", "override --comment"),
    ({"extra_sbatch_options": ["--signal=KILL@1"]}, "burst.extra_sbatch_options", "override --signal"),
    ({"extra_sbatch_options": ["--time=1:00:00"]}, "burst.extra_sbatch_options", "set burst.time_limit"),
    ({"extra_sbatch_options": ["--excl=node1"]}, "burst.extra_sbatch_options", "write --exclude=NODES in full"),
    ({"extra_sbatch_options": ["--hold"]}, "burst.extra_sbatch_options", "--hold is refused in a burst job"),
    ({"extra_sbatch_options": ["--test-only"]}, "burst.extra_sbatch_options", "nothing would be submitted"),
    ({"extra_sbatch_options": ["--array=0-3"]}, "burst.extra_sbatch_options", "each burst job is one job"),
    ({"extra_sbatch_options": ["--wrap=true"]}, "burst.extra_sbatch_options", "runs its own script"),
    ({"extra_sbatch_options": ["--begin=now+1hour"]}, "burst.extra_sbatch_options", "--begin is refused"),
    ({"extra_sbatch_options": ["-dafterok:5"]}, "burst.extra_sbatch_options", "--dependency is refused"),
    ({"extra_sbatch_options": ["--constraint=a100\nrm -rf ~"]}, "burst.extra_sbatch_options", "not an sbatch option"),
    ({"extra_sbatch_options": ["--constraint=a100; reboot"]}, "burst.extra_sbatch_options", "not an sbatch option"),
    ({"extra_sbatch_options": ["--constraint=$(reboot)"]}, "burst.extra_sbatch_options", "not an sbatch option"),
    ({"partition": "debug\n#SBATCH --job-name=x"}, "burst.partition", "not a Slurm name"),
    ({"account": "a b"}, "burst.account", "not a Slurm name"),
    ({"time_limit": "two hours"}, "burst.time_limit", "not a Slurm time"),
    ({"time_limit": "1:75:00"}, "burst.time_limit", "above 59"),
    ({"max_jobs": 1, "time_limit": "2", "signal_lead_s": 120}, "burst.time_limit", "longer than burst.signal_lead_s"),
])
def test_bad_burst_values_are_refused_naming_the_key(burst: dict[str, object], key: str, says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({"burst": burst})
    assert key in str(refused.value) and says in str(refused.value), str(refused.value)


@pytest.mark.parametrize(("text", "seconds"), [
    ("", 0), ("UNLIMITED", 0), ("0", 0), ("90", 5400), ("5:30", 330), ("02:00:00", 7200), ("1-0", 86400),
    ("1-02:30", 95400), ("2-00:00:01", 172801),
])
def test_slurm_time_limits_in_every_format(text: str, seconds: int) -> None:
    assert time_limit_s(text) == seconds


def test_good_sbatch_options_and_names_pass_through() -> None:
    burst = parse_config({"burst": {"partition": "scavenger,debug", "qos": "low-prio", "account": "rl_team.a",
                                    "time_limit": "1-00:00:00", "extra_sbatch_options": [
                                        "--constraint=a100|h100", "-Ca100", "--exclusive", "--mem-per-gpu=8G",
                                        "--nodelist=node2", "--time-min=30"]}}).burst
    assert burst.extra_sbatch_options[0] == "--constraint=a100|h100"


def test_memory_per_cpu_or_gpu_with_memory_per_worker_is_refused_naming_both_keys() -> None:
    with pytest.raises(ConfigError) as refused:  # sbatch refuses --mem with --mem-per-gpu at submit time
        parse_config({"workers": {"mem_per_worker_mb": 8000},
                      "burst": {"extra_sbatch_options": ["--mem-per-gpu=8G"]}})
    assert "burst.extra_sbatch_options" in str(refused.value) and "workers.mem_per_worker_mb" in str(refused.value)


def test_every_burst_key_is_read_where_burst_jobs_are_made() -> None:
    text = "".join(p.read_text() for p in (ROOT / "templates" / "burst_job.sbatch.j2", ROOT / "slurm_elastic" / "render.py",
                                           ROOT / "slurm_elastic" / "controller" / "burst_jobs.py"))
    for key in BurstSection.model_fields:
        assert re.search(rf"\bburst\.{key}\b", text), f"burst.{key} is accepted but never read"


def test_the_users_excluded_nodes_join_the_controllers_in_one_exclude() -> None:
    """sbatch keeps only the last of several --exclude: one line holds both, or the user's would
    undo the controller's (nodes whose every GPU is cordoned)."""
    config = parse_config({"workers": {"command": "w"}, "burst": {
        "max_jobs": 1, "extra_sbatch_options": ["--exclude=node9", "--constraint=a100", "-xnode[3-4]"]}})
    text = render_burst_script(config, 7, Path("/s/7"), exclude_nodes=("node2", "node9"))
    assert [line for line in text.splitlines() if "exclude" in line.lower() and line.startswith("#SBATCH")] == [
        "#SBATCH --exclude=node9,node[3-4],node2"]
    assert "#SBATCH --constraint=a100" in text


def test_the_burst_script_matches_its_golden_file(tmp_path: Path) -> None:
    config = load_config(DATA / "burst.toml")
    text = render_burst_script(config, 4242, Path("/shared/state/4242"), python="/opt/venv/bin/python")
    golden = DATA / "burst_job.sbatch"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
    assert "#SBATCH --gres=gpu:4\n" in text and "#SBATCH --cpus-per-task=6\n" in text  # 2 workers a node
    assert "#SBATCH --mem=16000M\n" in text and "#SBATCH --signal=USR1@90\n" in text
    script = tmp_path / "b.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0


def test_policy_and_slots_from_the_config() -> None:
    config = load_config(DATA / "burst.toml")
    assert worker_slots_per_job(config) == 4  # 8 GPUs over 2 nodes, 2 GPUs a worker
    policy = burst_policy(config)
    assert (policy.max_jobs, policy.worker_slots_per_job, policy.submit_cooldown_s) == (2, 4, 30.0)


# recorded on the dev cluster (Slurm 22.05): squeue --me --name=elastic-burst-99 --noheader --format=JOB_FORMAT
RECORDED = "\n".join(FIELD_SEP.join(f) for f in [
    ["15", "PENDING", "", "gres:gpu:4", "Resources", "N/A", "2", "scavenger", "elastic-burst-99",
     "/s/99/burst/burst_job.sbatch", "slurm-elastic burst parent=99"],
    ["14", "RUNNING", "node[1-2]", "gres:gpu:a100:4", "None", "2026-11-23T14:44:53", "2", "scavenger",
     "elastic-burst-99", "/s/99/burst/burst_job.sbatch", "slurm-elastic burst parent=99"],
    ["16", "PENDING", "", "(null)", "Priority", "2026-11-23T15:44:53", "1", "debug", "elastic-burst-99", "(null)",
     "(null)"],
]) + "\n"


def test_the_job_listing_parses_state_gpus_reason_and_start() -> None:
    pending, running, other = parse_job_lines(RECORDED)
    assert (pending.job_id, pending.state, pending.nodes, pending.gpus_per_node, pending.reason, pending.start_time) == (
        15, "PENDING", (), 4, "Resources", "")
    assert running.nodes == ("node1", "node2") and running.gpus_per_node == 4 and running.reason == ""
    assert other.comment == "" and other.gpus_per_node == 0 and other.command == ""
    assert running.command == "/s/99/burst/burst_job.sbatch"
    jobs = core_jobs([pending, running, other], 4, {14: 3}, {14: 1})
    assert [(j.phase, j.workers, j.draining_workers) for j in jobs] == [("PENDING", 0, 0), ("RUNNING", 3, 1),
                                                                       ("PENDING", 0, 0)]
    assert jobs[2].expected_start_s == start_time_s("2026-11-23T15:44:53") and jobs[0].expected_start_s is None
    with pytest.raises(Exception, match="unexpected squeue job line"):
        parse_job_lines("15|PENDING\n")


def test_a_step_in_another_job_gets_none_of_this_jobs_slurm_variables() -> None:
    inside = {"SLURM_JOB_ID": "377", "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_GPUS": "0,1,2,3", "SLURMD_NODENAME": "node1",
              "SLURM_CONF": "/etc/slurm.conf", "SLURM_ELASTIC_STATE_DIR": "/s", "PATH": "/bin"}
    assert step_launch_environ(inside, 377) == inside  # its own job: as it is
    assert step_launch_environ(inside, 378) == {"SLURM_CONF": "/etc/slurm.conf", "SLURM_ELASTIC_STATE_DIR": "/s",
                                                "PATH": "/bin"}
    assert step_launch_environ(inside, None) == step_launch_environ(inside, 378)  # sbatch of a new job
    outside = {"PATH": "/bin", "SLURM_CONF": "/c"}
    assert step_launch_environ(outside, 5) == outside


def test_the_watch_ends_after_the_grace_and_a_single_answer_restarts_it() -> None:
    now = [0.0]
    answers = iter([True, False, False, True, False, False, False, False])

    class Clockwork(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            now[0] += 10.0
            return False

    reason = watch(Path("/nowhere"), grace_s=25.0, interval_s=10.0, stop=Clockwork(),
                   answers=lambda _d: next(answers), clock=lambda: now[0])
    assert "unreachable for 30 s" in reason and now[0] == 60.0  # the last answer came at t=30


def test_the_watch_ends_at_once_when_the_controller_is_silent_and_the_parent_job_is_over() -> None:
    """A cancelled parent took its controller with it: the burst job does not hold its GPUs for the
    grace (300 s by default), and one that starts after its parent ended ends at its first probe."""
    now = [0.0]
    asked: list[float] = []

    class Clockwork(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            now[0] += 10.0
            return False

    def parent_over() -> str | None:
        asked.append(now[0])
        return "parent job 7 is CANCELLED" if now[0] >= 20 else None

    answers = iter([True, False, False, False])
    reason = watch(Path("/nowhere"), grace_s=300.0, interval_s=10.0, stop=Clockwork(),
                   answers=lambda _d: next(answers), clock=lambda: now[0], parent_over=parent_over)
    assert reason == "controller unreachable and parent job 7 is CANCELLED: ending this burst job"
    assert asked == [10.0, 20.0]  # Slurm is asked only while the controller is silent


class ListsJobs:
    def __init__(self, jobs: list[QueuedJob] | None = None, fails: bool = False) -> None:
        self.jobs, self.fails = jobs or [], fails

    def list_jobs(self, job_ids: list[int]) -> list[QueuedJob]:
        if self.fails:
            raise SlurmCommandError(["squeue"], 1, "", "slurm_load_jobs error: Socket timed out")
        return self.jobs


@pytest.mark.parametrize(("backend", "says"), [
    (ListsJobs([]), "parent job 7 is gone from Slurm's queue"),
    (ListsJobs([QueuedJob(7, "COMPLETING", (), 0, "", "", 1, "p", "n", "")]), "parent job 7 is COMPLETING"),
    (ListsJobs([QueuedJob(7, "RUNNING", (), 0, "", "", 1, "p", "n", "")]), None),
    (ListsJobs([QueuedJob(7, "PENDING", (), 0, "", "", 1, "p", "n", "")]), None),  # requeued: the grace decides
    (ListsJobs(fails=True), None),  # Slurm does not answer: the grace decides
])
def test_the_parent_job_is_over_when_slurm_lists_it_ending_or_no_more(backend: ListsJobs, says: str | None) -> None:
    assert parent_ended(7, backend) == says  # type: ignore[arg-type]


def test_the_watch_asks_the_real_controller_with_the_jobs_token(tmp_path: Path) -> None:
    served = subprocess.Popen([sys.executable, "-m", "tests.unit.served_api", str(tmp_path), "t0ken"], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert served.stdout is not None
        url = served.stdout.readline().strip()
        assert not controller_answers(tmp_path)  # nothing published yet
        (tmp_path / "controller.json").write_text(json.dumps({"url": url}))
        (tmp_path / "token").write_text("wrong\n")
        assert not controller_answers(tmp_path)
        (tmp_path / "token").write_text("t0ken\n")
        assert controller_answers(tmp_path)
    finally:
        assert served.stdin is not None
        served.stdin.close()
        served.wait(timeout=30)
    assert not controller_answers(tmp_path)


def test_in_a_burst_job_the_first_sigterm_drains_and_the_second_stops() -> None:
    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    try:
        plain, burst = Flags(), Flags()
        install_handlers(plain, signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert plain.terminate.is_set() and not plain.drain.is_set()
        install_handlers(burst, signal.SIGUSR1, term_drains=True)
        os.kill(os.getpid(), signal.SIGTERM)
        assert burst.drain.is_set() and not burst.terminate.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert burst.terminate.is_set()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_the_epilog_cancels_burst_jobs_only_for_a_slurm_elastic_job_and_on_its_first_node() -> None:
    from slurm_elastic.hooks.epilog import owns_burst_jobs

    ours = {"SLURM_JOB_COMMENT": "slurm-elastic:/shared/state/7", "SLURM_NODELIST": "node[1-2]"}
    assert owns_burst_jobs({**ours, "SLURMD_NODENAME": "node1"})
    assert not owns_burst_jobs({**ours, "SLURMD_NODENAME": "node2"})
    assert not owns_burst_jobs({**ours, "SLURM_JOB_COMMENT": "", "SLURMD_NODENAME": "node1"})
    assert owns_burst_jobs({"SLURM_JOB_COMMENT": "slurm-elastic:/s", "SLURMD_NODENAME": "x"})  # no node list: every node


def test_status_shows_burst_jobs_and_the_job_of_each_worker() -> None:
    from slurm_elastic.status_view import render_status

    status = {"controller": {
        "workers": [{"worker_id": "0001", "job_id": 7, "step_id": "3", "node": "node1", "gpus": [0], "state": "ACTIVE"},
                    {"worker_id": "0002", "job_id": 9, "step_id": "0", "node": "node2", "gpus": [1], "state": "ACTIVE"}],
        "burst": {"gpu_s_held": 120.0, "gpu_s_used": 60.0, "submitted": 2, "lost": 1},
        "burst_jobs": [{"job_id": 9, "state": "RUNNING", "nodes": ["node2"], "gpus": 2, "workers": 1, "pending_reason": ""},
                       {"job_id": 10, "state": "PENDING", "nodes": [], "gpus": 2, "workers": 0,
                        "pending_reason": "Resources"}]}}
    text = render_status(7, status)
    assert "WORKER  JOB  STEP" in text and "0002    9    0" in text
    assert "burst jobs: 2  held 120 GPU-s, used 60  submitted 2  lost 1" in text
    assert "10   PENDING  -      2     0        Resources" in text
    assert "JOB" not in render_status(7, {"controller": {"workers": status["controller"]["workers"][:1]}})


def test_status_text_says_the_burst_jobs_cancelled_and_the_last_decision() -> None:
    from slurm_elastic.status_view import render_status

    burst = {"gpu_s_held": 10.0, "gpu_s_used": 5.0, "submitted": 3, "cancelled": 2, "lost": 0, "requeued": 1,
             "last_decision": "burst: 2 slots missing beyond the allocation: submitting 1 job(s)",
             "errors": ["sbatch: error: old", "sbatch: error: Batch job submission failed"]}
    text = render_status(7, {"controller": {"burst": burst, "burst_jobs": []}})
    assert "submitted 3  lost 0  cancelled 2  requeued 1" in text
    assert "  decision: burst: 2 slots missing beyond the allocation: submitting 1 job(s)" in text


def test_the_epilog_runs_the_slurm_commands_of_slurm_bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """slurmd gives hooks PATH=/bin:/usr/bin: a Slurm installed elsewhere is named in hooks.toml."""
    from slurm_elastic.hooks.common import HookConfig
    from slurm_elastic.hooks.epilog import run

    bin_dir = tmp_path / "slurm" / "bin"
    bin_dir.mkdir(parents=True)
    for command in ("squeue", "scancel"):
        (bin_dir / command).write_text(f"#!/bin/sh\necho {command} \"$@\" >> {tmp_path}/calls\n")
        (bin_dir / command).chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_JOB_COMMENT": "slurm-elastic:/shared/state/7",
                        "SLURMD_NODENAME": "node1", "SLURM_NODELIST": "node1", "SLURM_JOB_USER": "alice"}.items():
        monkeypatch.setenv(name, value)
    config = HookConfig(node_state_dir=tmp_path / "state", log_file=tmp_path / "hooks.log",
                        slurm_bin_dir=str(bin_dir))

    assert run(config) == 0
    assert (tmp_path / "calls").read_text().startswith("squeue ")


def test_stop_and_the_epilog_cancel_every_burst_job_and_report_those_not_already_ending() -> None:
    """A live probe: after the trainer finished, the controller gave back its last burst job as it
    drained, and `slurm-elastic stop` then read "burst jobs 1000287 cancelled" of that job, which
    Slurm listed COMPLETING. Not reported, but still cancelled: a job Slurm requeues is listed
    COMPLETING first, and left alone it would run again with no controller."""
    from slurm_elastic.slurm.cli_backend import SlurmCli

    def job(job_id: int, state: str, comment: str = "slurm-elastic burst parent=7") -> QueuedJob:
        return QueuedJob(job_id, state, ("n2",), 2, "", "", 1, "p", "elastic-burst-7", comment)

    class Listed(SlurmCli):
        cancelled: list[int] = []

        def list_jobs_named(self, name: str, user: str | None = None) -> list[QueuedJob]:
            return [job(8, "COMPLETING"), job(9, "RUNNING"), job(10, "PENDING"), job(11, "SUSPENDED"),
                    job(12, "RUNNING", "slurm-elastic burst parent=6"), job(13, "PENDING", "slurm-elastic burst parent=7 released")]

        def cancel_job(self, job_id: int) -> None:
            self.cancelled.append(job_id)

    slurm = Listed()
    assert slurm.cancel_burst_jobs(7) == [9, 10, 11, 13] and slurm.cancelled == [8, 9, 10, 11, 13]
