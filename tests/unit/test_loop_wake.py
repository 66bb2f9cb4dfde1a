"""A request that changes the target runs the next tick at once, not at the tick interval; stop
still ends the loop at once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from slurm_elastic.controller.config import parse_config
from slurm_elastic.controller.runtime import Controller
from tests.stub_backend import ListedSteps

LONG_TICK_S = 600.0  # a test that waited for the interval would time out long before it


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    done = threading.Event()
    for _ in range(1000):
        if predicate():
            return
        done.wait(0.01)
    raise AssertionError(f"not {what} within 10 s (the tick interval is {LONG_TICK_S:g} s)")


def test_scale_wakes_the_loop_and_stop_ends_it(tmp_path: Path) -> None:
    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0},
                           "controller": {"tick_interval_s": LONG_TICK_S}, "workers": {"initial_workers": 0}})
    controller = Controller(config, 1, ListedSteps(), tmp_path, gpus_by_node={"node1": (0, 1)})  # type: ignore[arg-type]
    stop = threading.Event()
    loop = threading.Thread(target=controller.run_forever, args=(stop,))
    loop.start()
    try:
        wait_until(lambda: controller.ticks == 1, "the first tick")
        controller.scale(2)
        wait_until(lambda: controller.ticks == 2 and len(controller.workers) == 2, "a tick after the scale")
        controller.wake_all()
        wait_until(lambda: controller.ticks == 3, "a tick after wake-all")
        controller.resume()
        wait_until(lambda: controller.ticks == 4, "a tick after resume")
    finally:
        stop.set()
        loop.join(timeout=10)
    assert not loop.is_alive()
