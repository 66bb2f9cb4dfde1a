"""Rollout ingest: slurm-elastic's queue against Atropos' API server, in one run on one machine.

    python3 -m venv /tmp/atropos-venv && /tmp/atropos-venv/bin/pip install atroposlib
    .venv/bin/python bench/bench_ingest.py [--atropos /tmp/atropos-venv/bin/run-api]

Each server runs as its own process with its defaults; the same client (asyncio + httpx, groups
of 8 x 512 tokens encoded once up front) drives both. Reported: sequences/s and p50/p99 submit
latency at 1, 8 and 32 concurrent clients (medians of runs), memory per queued sequence, and
the time to hand out a batch with a backlog queued. Ratios are ours / theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import psutil

from bench._common import median, percentile, write_report

TOKENS = 512
GROUP = 8
AUTH = {"Authorization": "Bearer bench-token"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_SEQ = {"tokens": list(range(1000, 1000 + TOKENS)), "mask": [1] * TOKENS, "score": 0.5}
_OURS_TAIL = json.dumps({"worker_id": "0001", "policy_version": 0, "group_size": GROUP,
                         "sequences": [_SEQ] * GROUP})[1:].encode()


def ours_body(i: int) -> bytes:
    """One encoded group with a unique id (spliced into a body encoded once)."""
    return b'{"id":"g' + str(i).encode() + b'",' + _OURS_TAIL


_ATROPOS = json.dumps({"tokens": [list(range(1000, 1000 + TOKENS))] * GROUP, "masks": [[1] * TOKENS] * GROUP,
                       "scores": [0.5] * GROUP}).encode()


def atropos_body(_i: int) -> bytes:
    return _ATROPOS


class Server:
    def __init__(self, kind: str, argv: list[str], port: int) -> None:
        self.kind, self.port = kind, port
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(self.url + ("/healthz" if kind == "ours" else "/"), timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{kind} server did not start") from None
                time.sleep(0.2)
        if kind == "atropos":
            httpx.post(self.url + "/register", json={
                "wandb_group": "bench", "wandb_project": "bench", "batch_size": GROUP * 4, "max_token_len": 4096,
                "checkpoint_dir": "/tmp/atropos-ckpt", "save_checkpoint_interval": 10**6, "starting_step": 0,
                "num_steps": 10**6})

    @property
    def submit_path(self) -> str:
        return "/rollouts" if self.kind == "ours" else "/scored_data"

    def rss_mb(self) -> float:
        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


async def load(server: Server, make_body: Any, concurrency: int, seconds: float, start_id: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    sent = 0
    deadline = time.perf_counter() + seconds
    headers = {**AUTH, "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=concurrency)) as c:
        async def one_client(k: int) -> None:
            nonlocal sent
            i = k
            while time.perf_counter() < deadline:
                body = make_body(start_id + i)
                t0 = time.perf_counter()
                response = await c.post(server.submit_path, content=body, headers=headers)
                latencies.append(time.perf_counter() - t0)
                if response.status_code < 300:
                    sent += 1
                i += concurrency
        started = time.perf_counter()
        await asyncio.gather(*(one_client(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - started
    return sent * GROUP / elapsed, latencies


def fill(server: Server, make_body: Any, groups: int, start_id: int) -> None:
    async def go() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=16)) as c:
            sem = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                async with sem:
                    await c.post(server.submit_path, content=make_body(start_id + i),
                                 headers={**AUTH, "content-type": "application/json"})
            await asyncio.gather(*(one(i) for i in range(groups)))
    asyncio.run(go())


def pull_times(server: Server, pulls: int) -> list[float]:
    times = []
    with httpx.Client(base_url=server.url, timeout=300, headers=AUTH) as c:
        for _ in range(pulls):
            t0 = time.perf_counter()
            if server.kind == "ours":
                c.post("/trainer/batch")
            else:
                c.get("/batch")
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--atropos", default="/tmp/atropos-venv/bin/run-api")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--backlog", type=int, default=3000, help="groups queued before timing batch pulls")
    args = parser.parse_args()
    python = sys.executable
    here = Path(__file__).parent
    rows = ["| server | clients | sequences/s | p50 ms | p99 ms | ratio (seq/s) vs Atropos |", "|---|---|---|---|---|---|"]
    results: dict[tuple[str, int], float] = {}
    configs = [("atropos", [args.atropos], atropos_body), ("ours, fsync always", None, ours_body),
               ("ours, fsync off", None, ours_body)]
    memory_rows, pull_rows = [], []
    for name, argv, body in configs:
        port = free_port()
        if argv is None:
            fsync = "always" if "always" in name else "off"
            argv = [python, str(here / "_queue_server.py"), "--port", str(port), "--fsync", fsync]
        else:
            argv = [*argv, "--port", str(port)]
        server = Server("atropos" if name == "atropos" else "ours", argv, port)
        try:
            next_id = 0
            for concurrency in (1, 8, 32):
                rates, p50s, p99s = [], [], []
                for _ in range(args.runs):
                    rate, lat = asyncio.run(load(server, body, concurrency, args.seconds, next_id))
                    next_id += 10**6
                    rates.append(rate)
                    p50s.append(median(lat))
                    p99s.append(percentile(lat, 99))
                results[(name, concurrency)] = median(rates)
                ratio = "" if name == "atropos" else f"{median(rates) / results[('atropos', concurrency)]:.1f}x"
                rows.append(f"| {name} | {concurrency} | {median(rates):,.0f} | {median(p50s) * 1e3:.1f} | "
                            f"{median(p99s) * 1e3:.1f} | {ratio} |")
            if name != "ours, fsync off":
                if server.kind == "atropos":  # start from an empty queue
                    server.close()
                    server = Server("atropos", argv, port)
                else:
                    while httpx.post(server.url + "/trainer/batch", headers=AUTH).status_code == 200:
                        pass
                rss0 = server.rss_mb()
                fill(server, body, args.backlog, 5 * 10**7)
                rss1 = server.rss_mb()
                per_seq_kb = (rss1 - rss0) * 1024 / (args.backlog * GROUP)
                memory_rows.append((name, per_seq_kb, rss1))
                times = pull_times(server, 20)
                pull_rows.append((name, times[0], percentile(times, 99)))
        finally:
            server.close()
    mem = {n: kb for n, kb, _ in memory_rows}
    theirs, ours = mem.get("atropos", float("nan")), mem.get("ours, fsync always", float("nan"))
    pulls = {n: (first, p99) for n, first, p99 in pull_rows}
    write_report("ingest", "\n".join([
        f"## Rollout ingest: groups of {GROUP} x {TOKENS} tokens, one server process each, 2 cores", "",
        *rows, "",
        "| figure | Atropos | ours (fsync always) | ratio |", "|---|---|---|---|",
        f"| memory per queued sequence ({args.backlog} groups queued) | {theirs:.1f} KB | {ours:.2f} KB | "
        f"{ours / theirs if theirs else float('nan'):.3f}x |",
        f"| first batch pull with {args.backlog} groups queued | {pulls['atropos'][0] * 1e3:.0f} ms | "
        f"{pulls['ours, fsync always'][0] * 1e3:.1f} ms | |",
        f"| p99 of 20 batch pulls with the backlog | {pulls['atropos'][1] * 1e3:.1f} ms | "
        f"{pulls['ours, fsync always'][1] * 1e3:.1f} ms | |",
        "",
    ]))


if __name__ == "__main__":
    main()
