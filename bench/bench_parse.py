"""How long a large submit's parse holds the API's event loop: in a thread (the baseline, in the
same run) against the process the controller parses it in.

    ./run setup && .venv/bin/python bench/bench_parse.py      # no cluster needed; ~20 s

A 16 MB group (16 sequences of 500,000 tokens as JSON lists, what a client that does not use the
SDK's compact form sends) is parsed three times each way while the loop ticks every 5 ms; the
figure is the loop's longest wait between ticks, median of the three. pydantic holds the GIL while
it parses, so in a thread the loop waits for the whole parse.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slurm_elastic.controller.submit import _group_head

TOKENS_PER_SEQUENCE = 500_000
SEQUENCES = 16
RUNS = 3
TICK_S = 0.005


def large_group() -> bytes:
    sequence = '{"tokens":[' + ",".join(["1"] * TOKENS_PER_SEQUENCE) + '],"score":0.5}'
    head = f'{{"id":"big","worker_id":"0001","policy_version":0,"group_size":{SEQUENCES},"sequences":['
    return (head + ",".join([sequence] * SEQUENCES) + "]}").encode()


async def longest_wait_s(executor: Executor, body: bytes) -> tuple[float, float]:
    """(the loop's longest wait between ticks, the parse's wall time) for one parse in ``executor``."""
    loop = asyncio.get_running_loop()
    stop, waits = asyncio.Event(), []

    async def tick() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            waits.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.1)
    started = time.monotonic()
    await loop.run_in_executor(executor, _group_head, body)
    parse_s = time.monotonic() - started
    stop.set()
    await ticker
    return max(waits), parse_s


def main() -> None:
    body = large_group()
    rows = []
    process = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    process.submit(int).result()  # started before the runs, as a controller's is after its first large submit
    for name, executor in (("thread (baseline)", ThreadPoolExecutor(max_workers=1)), ("process (ours)", process)):
        runs = [asyncio.run(longest_wait_s(executor, body)) for _ in range(RUNS)]
        rows.append((name, statistics.median(w for w, _p in runs), statistics.median(p for _w, p in runs)))
        executor.shutdown()
    print(f"a {len(body) / 1e6:.0f} MB group, {RUNS} parses each, medians")
    print("| parsed in | the loop's longest wait | parse wall time |")
    print("|---|---|---|")
    for name, wait_s, parse_s in rows:
        print(f"| {name} | {wait_s * 1000:.0f} ms | {parse_s:.2f} s |")
    print(f"the loop waits {rows[0][1] / rows[1][1]:.0f}x less with the process")


if __name__ == "__main__":
    main()
