"""Rollout ingest: slurm-elastic's queue against Atropos' API server, in one run on one machine.

    apt-get install wrk
    python3 -m venv /tmp/atropos-venv && /tmp/atropos-venv/bin/pip install atroposlib
    .venv/bin/python bench/bench_ingest.py [--quick] [--atropos /tmp/atropos-venv/bin/run-api]

Each server runs as its own process with its defaults (ours as the controller serves it, the
queue's state on disk). One load generator drives both: ``wrk`` (C, keep-alive HTTP/1.1, one
thread) with bodies encoded up front, so the client is not what bounds the result; its CPU
and the server's are measured and reported. Groups are 8 sequences x 512 tokens with a mask
and a score. Atropos gets its JSON lists; ours gets what our worker SDK sends (``tokens_b64``,
``mask_b64``), plus one row with the same JSON lists for comparison.

Every recorded run starts with both servers' queues empty: Atropos' by its ``GET /reset_data``,
ours by pulling and acknowledging every batch (``POST /bench/empty`` of the bench's server).

Reported (ratios ours / theirs, medians of runs interleaved across the servers): sequences/s
and p50/p99 submit latency at 1, 8 and 32 connections, durability on (fsync always) and off, and
with the same JSON lists on both sides at 8 and 32; memory and disk per queued sequence with a
backlog; batch pull p50/p99 with that backlog; the latency of another request sent while
batches are pulled.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import psutil

from bench._common import median, percentile, write_headline, write_report
from bench._ingest_servers import (
    AUTH,
    BATCH_SEQS,
    EMPTY_BATCH_SEQS,
    GROUP,
    TOKENS,
    LoadResult,
    Server,
    Wrk,
)

CONCURRENCY = (1, 8, 32)
PULL_WAIT_S = 60.0  # Atropos' first /batch after a backlog takes seconds; a bound on the wait


def throughput(servers: list[Server], wrk: Wrk, runs: int, seconds: float) -> dict[tuple[str, int], list[LoadResult]]:
    """Runs interleaved across servers (so a noisy neighbour hits them alike)."""
    results: dict[tuple[str, int], list[LoadResult]] = {}
    for server in servers:  # not recorded: the first seconds of any server are slower (files grow, caches fill)
        wrk.run(server, 8, seconds)
        server.reset()
    for connections in CONCURRENCY:
        for _ in range(runs):
            for server in servers:
                if server.body == "lists" and connections == 1:
                    continue
                results.setdefault((server.name, connections), []).append(wrk.run(server, connections, seconds))
                server.reset()
    return results


@dataclass
class BacklogResult:
    queued_groups: int
    kb_per_seq: float
    rss_mb: float
    disk_kb_per_seq: float
    pulls_ms: list[float]
    probe_ms: list[float]  # another request's latency while the pulls run
    timed_out: bool


def fill(server: Server, wrk: Wrk, groups: int) -> None:
    """Submit ``groups`` groups (16 at a time; not timed)."""
    body_file = wrk.workdir / f"{server.body}.json"
    tail = body_file.read_text().encode()

    async def go() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers={**AUTH, "content-type": "application/json"},
                                     limits=httpx.Limits(max_connections=16)) as c:
            sem = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                body = tail if server.kind == "atropos" else b'{"id":"fill' + str(i).encode() + b'",' + tail
                async with sem:
                    await c.post(server.submit_path, content=body)
            await asyncio.gather(*(one(i) for i in range(groups)))
    asyncio.run(go())


def backlog(server: Server, wrk: Wrk, groups: int, pulls: int) -> BacklogResult:
    """Queue ``groups`` groups into a fresh server, then time batch pulls while a probe runs."""
    rss0, disk0 = server.rss_mb(), server.disk_bytes()
    fill(server, wrk, groups)
    queued = server.queued_groups()
    time.sleep(1.0)
    rss1, disk1 = server.rss_mb(), server.disk_bytes()
    probe_ms: list[float] = []
    pulling = threading.Event()
    done = threading.Event()

    def probe() -> None:
        path = "/global-status" if server.kind == "ours" else "/status"
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=PULL_WAIT_S + 5) as c:
            pulling.wait()
            while not done.is_set():
                t0 = time.perf_counter()
                c.get(path)
                probe_ms.append((time.perf_counter() - t0) * 1e3)
                time.sleep(0.005)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    pulls_ms: list[float] = []
    timed_out = False
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=PULL_WAIT_S) as c:
        pulling.set()
        time.sleep(0.05)
        for _ in range(pulls):
            t0 = time.perf_counter()
            try:
                response = c.post("/trainer/batch") if server.kind == "ours" else c.get("/batch")
            except httpx.TimeoutException:
                timed_out = True
                pulls_ms.append(PULL_WAIT_S * 1e3)
                break
            pulls_ms.append((time.perf_counter() - t0) * 1e3)
            if server.kind == "ours" and response.status_code == 200:
                c.post(f"/trainer/batch/{response.json()['batch_id']}/ack")
    time.sleep(0.05)
    done.set()
    prober.join(timeout=PULL_WAIT_S + 10)
    per_seq_kb = (rss1 - rss0) * 1024 / max(1, queued * GROUP)
    disk_kb = (disk1 - disk0) / 1024 / max(1, queued * GROUP)
    return BacklogResult(queued, per_seq_kb, rss1, disk_kb, pulls_ms, probe_ms, timed_out)


def ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.1f}x" if theirs else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--atropos", default="/tmp/atropos-venv/bin/run-api")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of one load run")
    parser.add_argument("--runs", type=int, default=3, help="runs per point (the median is reported)")
    parser.add_argument("--backlog", type=int, default=20_000, help="groups queued before timing batch pulls")
    parser.add_argument("--pulls", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="a short run: 2 s loads, a 2,000-group backlog")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.backlog, args.pulls = 2, 2000, 20
    if not Path(args.atropos).exists():
        raise SystemExit(f"Atropos' run-api not found at {args.atropos}: python3 -m venv /tmp/atropos-venv && "
                         "/tmp/atropos-venv/bin/pip install atroposlib")
    here = Path(__file__).parent
    ours = [sys.executable, str(here / "_queue_server.py")]
    atropos_argv = [args.atropos, "--host", "127.0.0.1"]
    workdir = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    wrk = Wrk(workdir)

    def fresh() -> list[Server]:
        return [Server("Atropos", "atropos", atropos_argv, "atropos"),
                Server("ours, fsync always", "ours", [*ours, "--fsync", "always"], "sdk"),
                Server("ours, fsync off", "ours", [*ours, "--fsync", "off"], "sdk"),
                Server("ours, fsync always, JSON lists", "ours", [*ours, "--fsync", "always"], "lists")]

    servers = fresh()
    for s in servers:  # the load runs pull nothing: a large batch makes emptying between runs quick
        if s.kind == "ours":
            s.argv = [*s.argv, "--batch-seqs", str(EMPTY_BATCH_SEQS)]
    try:
        for s in servers:
            s.start()
        loads = throughput(servers, wrk, args.runs, args.seconds)
    finally:
        for s in servers:
            s.close()
    backlogs: dict[str, BacklogResult] = {}
    for s in fresh()[:2]:
        try:
            backlogs[s.name] = backlog(s.start(), wrk, args.backlog, args.pulls)
        finally:
            s.close()
    shutil.rmtree(workdir, ignore_errors=True)
    write_report("ingest", report(loads, backlogs, args))
    write_headline("ingest", headline(loads, backlogs))


def headline(loads: dict[tuple[str, int], list[LoadResult]],
             backlogs: dict[str, BacklogResult]) -> list[tuple[str, str, str, str]]:
    def rate(name: str, connections: int) -> float:
        return median([r.seqs_per_s for r in loads[(name, connections)]])
    theirs, mine = backlogs["Atropos"], backlogs["ours, fsync always"]
    forms = [("ours, fsync always", "ours: SDK form (tokens_b64, mask_b64), Atropos: JSON lists"),
             ("ours, fsync always, JSON lists", "JSON lists on both sides")]
    rows = [(f"rollout ingest, 8 x 512-token groups, {c} connections, fsync always, {words} (vs Atropos' server)",
             f"{rate(name, c):,.0f} seq/s", f"{rate('Atropos', c):,.0f} seq/s",
             f"{rate(name, c) / rate('Atropos', c):.1f}x") for name, words in forms for c in (8, 32)]
    rows += [
        (f"memory (RSS) / disk per queued sequence ({mine.queued_groups:,} groups queued; ours with its syncer process)",
         f"{mine.kb_per_seq:.3f} KB / {mine.disk_kb_per_seq:.1f} KB", f"{theirs.kb_per_seq:.1f} KB / none (memory only)",
         f"RSS {mine.kb_per_seq / theirs.kb_per_seq:.4f}x" if theirs.kb_per_seq else ""),
        (f"batch pull with {mine.queued_groups:,} groups queued: first / p99",
         f"{mine.pulls_ms[0]:,.1f} / {percentile(mine.pulls_ms, 99):,.1f} ms",
         f"{theirs.pulls_ms[0]:,.1f} / {percentile(theirs.pulls_ms, 99):,.1f} ms", ""),
        ("another request during the pulls, worst", f"{max(mine.probe_ms, default=float('nan')):,.1f} ms",
         f"{max(theirs.probe_ms, default=float('nan')):,.1f} ms", ""),
    ]
    return rows


def report(loads: dict[tuple[str, int], list[LoadResult]], backlogs: dict[str, BacklogResult],
           args: argparse.Namespace) -> str:
    rows = ["| server | connections | sequences/s | p50 ms | p99 ms | vs Atropos (seq/s) | server CPU | client CPU | failed |",
            "|---|---|---|---|---|---|---|---|---|"]
    seqs: dict[tuple[str, int], float] = {}
    for (name, connections), results in loads.items():
        seqs[(name, connections)] = median([r.seqs_per_s for r in results])
    for (name, connections), results in sorted(loads.items(), key=lambda kv: (kv[0][1], kv[0][0] != "Atropos")):
        rate = seqs[(name, connections)]
        vs = "" if name == "Atropos" else ratio(rate, seqs[("Atropos", connections)])
        rows.append(f"| {name} | {connections} | {rate:,.0f} | {median([r.p50_ms for r in results]):.1f} | "
                    f"{median([r.p99_ms for r in results]):.1f} | {vs} | "
                    f"{median([r.server_cpu_pct for r in results]):.0f}% | "
                    f"{median([r.client_cpu_pct for r in results]):.0f}% | {sum(r.failed for r in results)} |")
    theirs, mine = backlogs["Atropos"], backlogs["ours, fsync always"]

    def pull_cell(b: BacklogResult, pct: float) -> str:
        return f"{percentile(b.pulls_ms, pct):,.1f} ms" + (" (timed out)" if b.timed_out and pct == 100 else "")

    backlog_rows = [
        "| figure | Atropos | ours (fsync always) | ours / Atropos |", "|---|---|---|---|",
        f"| groups queued | {theirs.queued_groups:,} | {mine.queued_groups:,} | |",
        f"| server memory (RSS) with the backlog | {theirs.rss_mb:,.0f} MB | {mine.rss_mb:,.0f} MB | |",
        f"| memory per queued sequence | {theirs.kb_per_seq:.1f} KB | {mine.kb_per_seq:.3f} KB | "
        f"{mine.kb_per_seq / theirs.kb_per_seq if theirs.kb_per_seq else float('nan'):.4f}x |",
        f"| disk per queued sequence (payload log and index) | none (memory only) | {mine.disk_kb_per_seq:.2f} KB | |",
        f"| first batch pull | {theirs.pulls_ms[0]:,.1f} ms | {mine.pulls_ms[0]:,.1f} ms | |",
        f"| batch pull p50 ({len(mine.pulls_ms)} pulls) | {pull_cell(theirs, 50)} | {pull_cell(mine, 50)} | |",
        f"| batch pull p99 | {pull_cell(theirs, 99)} | {pull_cell(mine, 99)} | |",
        f"| another request while pulling (Atropos GET /status, ours GET /global-status): p50 | "
        f"{percentile(theirs.probe_ms, 50):,.1f} ms | {percentile(mine.probe_ms, 50):,.1f} ms | |",
        f"| the same, worst | {max(theirs.probe_ms, default=float('nan')):,.1f} ms | "
        f"{max(mine.probe_ms, default=float('nan')):,.1f} ms | |",
    ]
    cpu = psutil.cpu_count()
    return "\n".join([
        f"## Rollout ingest: groups of {GROUP} x {TOKENS} tokens (+ mask, score), one server process each, "
        f"{cpu} cores shared by server and load generator",
        "",
        f"Load generator: wrk, 1 thread, keep-alive, N connections; {args.runs} runs of {args.seconds:g} s per point, "
        "interleaved across servers, after one unrecorded warm-up run each; medians. Every run starts with "
        "the server's queue empty (Atropos: GET /reset_data; ours: every batch pulled and acknowledged, "
        f"in batches of {EMPTY_BATCH_SEQS} sequences). CPU columns: % of one core used by the server process and by "
        "wrk during the run. Ours receives what the worker SDK sends (tokens_b64, mask_b64) unless the row says "
        "JSON lists (the same lists Atropos receives).",
        "",
        *rows, "",
        f"Backlog: {args.backlog:,} groups queued into a fresh server, then {args.pulls} batch pulls of "
        f"{BATCH_SEQS} sequences (ours: each acknowledged), with another request sent every 5 ms meanwhile. "
        f"A pull waits at most {PULL_WAIT_S:.0f} s.",
        "",
        *backlog_rows, "",
        f"Machine: {os.uname().machine}, {cpu} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
        "other work on the machine during the run is not controlled (the runs are interleaved for that).",
        "",
    ])


if __name__ == "__main__":
    main()
