"""One writer owns the payload log: a new store waits (bounded, naming the holder) while the
syncer of a killed controller still lives, so it cannot overwrite what the new one commits.
Real processes: an old controller in a subprocess, its syncer stopped with SIGSTOP."""

from __future__ import annotations

import json
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
