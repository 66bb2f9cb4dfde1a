"""The one place that runs commands: errors, timeouts, counting, detached launch, srun argv."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from slurm_elastic.errors import SlurmCommandError, SlurmNotInstalledError, SlurmTimeoutError
from slurm_elastic.slurm import runner
from slurm_elastic.slurm.backend import StepSpec, build_srun_argv
from slurm_elastic.slurm.pyslurm_backend import select_backend
from slurm_elastic.slurm.runner import command_counts, process_alive, run_command, spawn_detached


def test_missing_binary_names_the_debian_package() -> None:
    with pytest.raises(SlurmNotInstalledError, match="apt-get install slurm-client"):
        run_command(["squeue-does-not-exist"])


def test_nonzero_exit_carries_rc_stdout_stderr() -> None:
    with pytest.raises(SlurmCommandError) as info:
        run_command(["sh", "-c", "echo out; echo boom >&2; exit 3"])
    assert info.value.returncode == 3
    assert info.value.stdout == "out\n"
    assert "boom" in info.value.stderr and "boom" in str(info.value)


def test_timeout_is_its_own_error() -> None:
    with pytest.raises(SlurmTimeoutError, match="timed out"):
        run_command(["sleep", "5"], timeout_s=0.2)


def test_calls_are_counted_per_program() -> None:
    before = command_counts().get("true", 0)
    run_command(["true"])
    run_command(["/bin/true"])
    assert command_counts()["true"] == before + 2


def test_spawn_detached_runs_in_its_own_session(tmp_path: Path) -> None:
    pid = spawn_detached(["sleep", "30"], log_path=tmp_path / "x.log")
    try:
        assert os.getsid(pid) == pid != os.getsid(0)
        assert process_alive(pid)
    finally:
        os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        if not process_alive(pid):
            break
        time.sleep(0.02)
    assert not process_alive(pid)


def test_a_child_killed_by_a_signal_is_noted_in_its_log_until_the_next_spawn(tmp_path: Path) -> None:
    """kill -9 of a worker's srun ends its step: the log then says so, for the controller to read."""
    log = tmp_path / "0001.log"
    pid = spawn_detached(["sleep", "30"], log_path=log)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while runner.killed_since_spawned(log) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runner.killed_since_spawned(log) == f"slurm-elastic: sleep (pid {pid}) was killed by signal 9 (SIGKILL)"
    spawn_detached(["true"], log_path=log)  # its relaunch, which ends by itself
    time.sleep(2 * runner.REAP_INTERVAL_S + 0.2)
    assert runner.killed_since_spawned(log) is None
    assert runner.killed_since_spawned(tmp_path / "none.log") is None


def test_srun_argv_golden(tmp_path: Path) -> None:
    spec = StepSpec(
        job_id=42, name="se-w-0007", argv=("python3", "-m", "worker"), output_path=Path("/s/w7.out"),
        gpus=2, cpus=4, mem_mb=2048, exclude=("node3",), env={"B": "2", "A": "1"},
    )
    assert build_srun_argv(spec) == [
        "srun", "--jobid=42", "--job-name=se-w-0007", "--nodes=1", "--ntasks=1", "--cpus-per-task=4",
        "--exact", "--input=none", "--output=/s/w7.out", "--open-mode=append",
        "--kill-on-bad-exit=1", "--gres=gpu:2",
        "--mem=2048M", "--exclude=node3", "--export=ALL", "--", "python3", "-m", "worker",
    ]


def test_srun_argv_overlap_without_gpus() -> None:
    argv = build_srun_argv(StepSpec(job_id=1, name="se-a-node1", argv=("x",), output_path=Path("o"),
                                    gpus=0, overlap=True, nodelist=("node1",)))
    assert "--overlap" in argv and "--exact" not in argv
    assert not any(a.startswith("--gres") for a in argv)
    assert "--nodelist=node1" in argv


def test_backend_falls_back_to_cli_without_pyslurm() -> None:
    assert select_backend("auto").name == "cli"
    assert select_backend("cli").name == "cli"


def test_detached_children_are_reaped_by_one_shared_thread(tmp_path: Path) -> None:
    threads_before = threading.active_count()
    pids = [spawn_detached(["true"], log_path=tmp_path / "t.log") for _ in range(20)]
    assert threading.active_count() <= threads_before + 1  # not a thread per child
    deadline = time.monotonic() + 30
    while runner._reaper.pending() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert runner._reaper.pending() == 0
    zombies = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() == psutil.STATUS_ZOMBIE]
    assert zombies == []


def test_controller_slurm_timeout_s_is_the_timeout_of_its_slurm_commands(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung ``squeue`` (a script that sleeps) is cut off after the configured timeout, not the default 30 s."""
    from slurm_elastic.controller.config import parse_config
    from slurm_elastic.controller.main import running_job, slurm_backend

    monkeypatch.setattr(runner, "_timeout_s", runner.DEFAULT_TIMEOUT_S)  # restored after the test
    (tmp_path / "squeue").write_text("#!/bin/sh\nexec sleep 20\n")
    (tmp_path / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    config = parse_config({"controller": {"slurm_timeout_s": 0.3, "slurm_backend": "cli"}})
    with pytest.raises(SlurmTimeoutError, match=r"timed out after 0\.3 s"):
        running_job(slurm_backend(config), 12345)
    assert runner.command_timeout_s() == 0.3


def test_the_reaper_wakes_when_a_child_ends_not_on_a_timer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With pidfds its thread sleeps until a child ends: a child killed once the thread sleeps is
    noted although the polling interval is an hour (it takes no CPU while 256 workers' sruns run)."""
    monkeypatch.setattr(runner, "REAP_INTERVAL_S", 3600.0)
    reaper = runner._Reaper()
    log = tmp_path / "0001.log"
    log.write_text(f"{runner.SPAWNED} sleep\n")
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    reaper.adopt(proc, log)
    time.sleep(0.5)  # the adoption's own wake-up is over: the thread sleeps in poll()
    proc.kill()
    deadline = time.monotonic() + 10
    while reaper.pending() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert reaper.pending() == 0 and proc.returncode == -signal.SIGKILL
    assert runner.killed_since_spawned(log) == f"slurm-elastic: sleep (pid {proc.pid}) was killed by signal 9 (SIGKILL)"


@pytest.mark.parametrize("pidfds", ["missing", "all taken"])
def test_children_without_a_pidfd_are_polled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pidfds: str) -> None:
    """A kernel without pidfd_open (before 5.3), or more children than PIDFDS_MAX: those children
    are polled every REAP_INTERVAL_S; they end after the adoptions' wake-ups, so only the polling
    can find them."""
    if pidfds == "missing":
        def no_pidfds(pid: int) -> int:
            raise OSError(38, "Function not implemented")
        monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    else:
        monkeypatch.setattr(runner, "PIDFDS_MAX", 1)
    monkeypatch.setattr(runner, "REAP_INTERVAL_S", 0.05)
    reaper = runner._Reaper()
    procs = [subprocess.Popen(["sleep", "0.5"]) for _ in range(3)]
    for proc in procs:
        reaper.adopt(proc, tmp_path / "t.log")
    deadline = time.monotonic() + 10
    while reaper.pending() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert reaper.pending() == 0 and all(p.returncode == 0 for p in procs)
