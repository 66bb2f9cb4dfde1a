"""PauseWatch: time the controller's process did not run, from a thread's late wake-ups."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from slurm_elastic.controller.pause_watch import PauseWatch


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_late_wake_ups_count_their_lateness_once() -> None:
    clock = Clock()
    watch = PauseWatch(interval_s=0.5, threshold_s=3.0, clock=clock)
    clock.now_s += 0.5
    watch.beat()
    clock.now_s += 2.0  # a slow wake-up, not a pause
    watch.beat()
    assert watch.take() == 0.0
    clock.now_s += 20.5  # stopped for 20 s
    watch.beat()
    clock.now_s += 0.5
    assert watch.take() == 20.0
    assert watch.take() == 0.0


def test_take_counts_a_pause_the_thread_has_not_woken_from() -> None:
    clock = Clock()
    watch = PauseWatch(interval_s=0.5, threshold_s=3.0, clock=clock)
    clock.now_s += 30.5  # the tick runs first after the resume
    assert watch.take() == 30.0
    clock.now_s += 0.5
    watch.beat()  # the thread wakes after it: nothing counted twice
    assert watch.take() == 0.0



def test_the_total_lost_counts_each_pause_once_whoever_takes_it_first() -> None:
    """A heartbeat reads it to know how long its worker was stopped since its last, before or after
    the tick takes the pause."""
    clock = Clock()
    watch = PauseWatch(interval_s=0.5, threshold_s=3.0, clock=clock)
    assert watch.lost_total_s() == 0.0
    clock.now_s += 22.5  # a pause nobody has noticed yet
    assert watch.lost_total_s() == 22.0
    assert watch.take() == 22.0 and watch.lost_total_s() == 22.0  # taken: still in the total, once
    clock.now_s += 0.5
    watch.beat()
    clock.now_s += 10.5
    watch.beat()
    assert watch.lost_total_s() == 32.0 and watch.take() == 10.0 and watch.lost_total_s() == 32.0

def test_a_late_wake_up_the_process_spent_computing_is_no_pause() -> None:
    """A long garbage collection or a tick holding the interpreter's lock holds the thread back, but the
    process ran (its CPU time moved on by about the lateness) and its workers were not stopped."""
    clock, cpu = Clock(), Clock()
    watch = PauseWatch(interval_s=0.5, threshold_s=3.0, clock=clock, cpu_clock=cpu)
    clock.now_s += 8.5
    cpu.now_s += 2.0  # computing, on a busy host
    assert watch.take() == 0.0 and watch.lost_total_s() == 0.0
    clock.now_s += 10.5
    cpu.now_s += 0.01  # stopped
    watch.beat()
    assert watch.take() == 10.0


_CHILD = """
import sys, time
from slurm_elastic.controller.pause_watch import PauseWatch
watch = PauseWatch()
watch.start()
print("ready", flush=True)
sys.stdin.readline()
print(watch.take(), flush=True)
watch.stop()
"""


def test_a_process_stopped_with_sigstop_knows_how_long() -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(5)
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("\n")
        child.stdin.flush()
        lost_s = float(child.stdout.readline())
    finally:
        child.kill()
        child.wait()
    assert 3.5 <= lost_s <= 5.5


_HOLDER = """
import sys, time
from slurm_elastic.controller.pause_watch import PauseWatch
watch = PauseWatch()
watch.start()
sys.setswitchinterval(30.0)  # the watch's thread gets the interpreter's lock back only after the loop
end_s = time.process_time() + 4.0  # 4 s of computing, however long a busy host takes to give them
while time.process_time() < end_s:
    pass
sys.setswitchinterval(0.005)
time.sleep(1.0)
print(watch.take(), flush=True)
watch.stop()
"""


def test_a_process_that_holds_its_own_thread_back_is_not_paused() -> None:
    done = subprocess.run([sys.executable, "-c", _HOLDER], capture_output=True, text=True, timeout=60, check=True)
    assert float(done.stdout) == 0.0
