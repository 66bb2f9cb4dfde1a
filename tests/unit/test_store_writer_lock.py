"""One writer owns the payload log: a new store waits (bounded, naming the holder) while the
syncer of a killed controller still lives, so it cannot overwrite what the new one commits.
Real processes: an old controller in a subprocess, its syncer stopped with SIGSTOP."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_elastic.errors import StateFileError
from slurm_elastic.rollouts import store as store_module
from slurm_elastic.rollouts.recovery import lock_log_dir
from slurm_elastic.rollouts.store import RolloutStore

OLD_CONTROLLER = """
import sys, time
from pathlib import Path
from slurm_elastic.rollouts.store import RolloutStore
store = RolloutStore(Path(sys.argv[1]))
store.insert("acked-1", "0001", 4, 0, b'{"id": "acked-1"}')
print(store._syncer.pid, flush=True)
sys.stdin.readline()  # the test stops the syncer: the next commit hangs, as on a slow disk
store.insert_later("in-flight", "0001", 4, 0, b'{"id": "in-flight", "pad": "%s"}' % (b"x" * 300))
while store._in_flight is None:
    time.sleep(0.01)
print("sent", flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        assert time.monotonic() < deadline, f"process {pid} did not exit"
        time.sleep(0.02)


@pytest.fixture
def stalled_syncer(tmp_path: Path) -> Iterator[int]:
    """A killed controller whose syncer is stopped with a commit in its input: the syncer's pid."""
    old = subprocess.Popen([sys.executable, "-c", OLD_CONTROLLER, str(tmp_path / "q.sqlite")],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert old.stdin is not None and old.stdout is not None
    syncer_pid = int(old.stdout.readline())
    os.kill(syncer_pid, signal.SIGSTOP)
    old.stdin.write("go\n")
    old.stdin.flush()
    assert old.stdout.readline().strip() == "sent"
    old.kill()  # kill -9 of the controller; its syncer lives on, stalled
    old.wait()
    try:
        yield syncer_pid
    finally:
        if alive(syncer_pid):
            os.kill(syncer_pid, signal.SIGCONT)
            wait_gone(syncer_pid)


def test_a_new_store_is_refused_while_the_old_syncer_lives_and_names_it(tmp_path: Path,
                                                                        stalled_syncer: int) -> None:
    with pytest.raises(StateFileError, match=rf"in use by .*syncer pid {stalled_syncer}"):
        RolloutStore(tmp_path / "q.sqlite", lock_wait_s=0.2)
    os.kill(stalled_syncer, signal.SIGCONT)  # the old commit lands, then the old syncer exits
    wait_gone(stalled_syncer)
    store = RolloutStore(tmp_path / "q.sqlite", lock_wait_s=0.2)
    assert store.insert("acked-2", "0002", 4, 0, b'{"id": "acked-2"}') is not None
    store.close()
    store = RolloutStore(tmp_path / "q.sqlite")
    queued = [g.id for g in store.queued()]
    assert queued == ["acked-1", "in-flight", "acked-2"]  # the old commit took its own place
    bodies = store.hand_out("b", queued, 1.0)
    assert [json.loads(b)["id"] for b in bodies] == queued and store.lost() == []
    store.close()


def test_a_new_store_waits_for_the_old_syncer_then_opens(tmp_path: Path, stalled_syncer: int) -> None:
    opened: list[RolloutStore] = []
    opening = threading.Thread(target=lambda: opened.append(RolloutStore(tmp_path / "q.sqlite", lock_wait_s=60)))
    opening.start()
    opening.join(0.3)
    assert opening.is_alive() and not opened  # cannot open: the stopped syncer still holds the log
    os.kill(stalled_syncer, signal.SIGCONT)
    opening.join(60)
    (store,) = opened
    assert store.insert("acked-2", "0002", 4, 0, b'{"id": "acked-2"}') is not None
    bodies = store.hand_out("b", [g.id for g in store.queued()], 1.0)
    assert [json.loads(b)["id"] for b in bodies] == ["acked-1", "in-flight", "acked-2"]
    store.close()


def test_two_stores_on_one_path_in_one_process_are_refused(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "q.sqlite")
    with pytest.raises(StateFileError, match=f"controller pid {os.getpid()}"):
        RolloutStore(tmp_path / "q.sqlite", lock_wait_s=0)
    store.close()
    RolloutStore(tmp_path / "q.sqlite", lock_wait_s=0).close()


def test_the_log_directory_lock_waits_for_a_holder_to_go_then_refuses(tmp_path: Path) -> None:
    """Before, the first try that found it held refused, though a writer letting go frees it just
    after the lock file (an opener polling the lock file could come in between)."""
    log_dir = tmp_path / "q.segments"
    log_dir.mkdir()
    holder = os.open(log_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    with pytest.raises(StateFileError, match=r"waited 0.1 s"):
        lock_log_dir(tmp_path / "q.sqlite", log_dir, 0.1)
    threading.Timer(0.2, os.close, (holder,)).start()
    fd = lock_log_dir(tmp_path / "q.sqlite", log_dir, 30.0)
    assert fd is not None
    os.close(fd)


def test_close_lets_go_of_the_log_directory_before_the_lock_file(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    store = RolloutStore(tmp_path / "q.sqlite")
    assert store.insert("a", "w", 4, 0, b'{"id": "a"}') is not None
    locks, closed = [store._dir_lock, store._writer_lock], []
    real_close = os.close
    monkeypatch.setattr(os, "close", lambda fd: (closed.append(fd), real_close(fd))[1])
    store.close()
    assert [fd for fd in closed if fd in locks] == locks


def test_a_new_stores_log_directory_is_locked_once_made(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "q.sqlite")
    fd = os.open(tmp_path / "q.segments", os.O_RDONLY | os.O_DIRECTORY)
    with pytest.raises(BlockingIOError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)
    store.close()


def test_a_file_system_without_directory_locks_is_said_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    real_flock = fcntl.flock

    def flock(fd: int, op: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOLCK, "no locks available")
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with caplog.at_level(logging.WARNING):
        RolloutStore(tmp_path / "q.sqlite").close()
    assert caplog.text.count("refuses a lock on its payload log") == 1


def test_a_refused_log_directory_lock_leaves_nothing_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*_args: object) -> None:
        raise StateFileError("in use")

    monkeypatch.setattr(store_module, "lock_log_dir", refused)
    before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(StateFileError, match="in use"):
        RolloutStore(tmp_path / "q.sqlite")  # a new store: its directory is locked once made
    assert sorted(os.listdir("/proc/self/fd")) == before


def test_a_digit_named_file_that_is_no_segment_is_no_log_without_its_index(tmp_path: Path) -> None:
    (tmp_path / "q.segments").mkdir()
    (tmp_path / "q.segments" / "1.log").write_bytes(b"notes")
    RolloutStore(tmp_path / "q.sqlite").close()
    assert (tmp_path / "q.segments" / "1.log").read_bytes() == b"notes"


def test_a_wait_for_the_log_directory_past_a_second_is_said_once(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    log_dir = tmp_path / "q.segments"
    log_dir.mkdir()
    holder = os.open(log_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    threading.Timer(1.5, os.close, (holder,)).start()
    with caplog.at_level(logging.WARNING, logger="slurm_elastic.rollouts.recovery"):
        fd = lock_log_dir(tmp_path / "q.sqlite", log_dir, 30.0)
    assert fd is not None
    os.close(fd)
    assert caplog.text.count("waiting up to 30 s for the process that holds its payload log") == 1, caplog.text
