"""The controller's CPU per worker heartbeat, against a bare uvicorn app answering the same bytes.

    .venv/bin/python bench/bench_heartbeat_cost.py        # no cluster needed; ~1 minute

At 256 workers heart-beating every 5 s the controller answers 51 heartbeats a second, most of its
CPU at that size. Each server runs in its own process (ours: the controller's app with one
registered worker, served as the controller serves it, its tick loop not running; the baseline:
a plain ASGI app on uvicorn with httptools and uvloop, as ours, that reads the body and answers the
same JSON). One client, the worker step's own (``client/step_calls.py``), sends heartbeats:
spaced at the rate of 256 workers on one kept-alive connection, the same with a new connection
each, and back to back; and node agent reports, on the fast path and through the route. The figure
is the server process's CPU time per request (user + system, the loopback TCP work of its side
included), medians of three runs interleaved.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
import tempfile
import threading
import time
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import median, write_headline, write_report
from slurm_elastic.client.step_calls import StepControlClient

TOKEN = "bench-token"
RATE_PER_S = 256 / 5.0  # 256 workers at the default heartbeat interval
ANSWER = json.dumps({"drain": False, "hold": False, "register": False}, separators=(",", ":")).encode()
PATTERNS = ("spaced, kept alive", "spaced, a new connection each", "back to back, kept alive")


def serve_ours(ready: Queue[Any], done: Queue[Any], fast_reports: bool = True) -> None:
    from slurm_elastic.controller.app import create_controller_app
    from slurm_elastic.controller.config import parse_config
    from slurm_elastic.controller.runtime import Controller
    from slurm_elastic.controller.serve import ApiServer
    from tests.stub_backend import ListedSteps

    config = parse_config({"agent": {"enabled": False}, "autoscaler": {"min_workers": 0}})
    controller = Controller(config, 1, ListedSteps(), Path(tempfile.mkdtemp()), gpus_by_node={"n1": (0,)})  # type: ignore[arg-type]
    controller.scale(1)
    controller.tick()
    worker_id = next(iter(controller.workers))
    controller.register_worker(worker_id, {"node": "n1", "gpus": [0], "step_id": "3"})
    app = create_controller_app(controller, TOKEN)
    if not fast_reports:
        app.agent_report_endpoint = None  # every agent report through the FastAPI route
    server = ApiServer(app, "127.0.0.1")
    server.start()
    ready.put((server.url, worker_id))
    done.get()
    server.stop()


def serve_bare(ready: Queue[Any], done: Queue[Any]) -> None:
    import uvicorn

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]})
        await send({"type": "http.response.body", "body": ANSWER})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http="httptools", loop="uvloop", lifespan="off", log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    ready.put((f"http://127.0.0.1:{sock.getsockname()[1]}", "0001"))
    done.get()
    server.should_exit = True


def cpu_per_beat_us(pattern: str, url: str, worker_id: str, server: psutil.Process, beats: int) -> float:
    client = StepControlClient(url, TOKEN)
    client.heartbeat(worker_id, {"busy": True})
    before = sum(server.cpu_times()[:2])
    start = time.monotonic()
    for i in range(beats):
        if not pattern.startswith("back to back"):
            time.sleep(max(0.0, start + i / RATE_PER_S - time.monotonic()))
        if pattern.endswith("a new connection each"):
            client.close()
        client.heartbeat(worker_id, {"busy": True})
    used_s = sum(server.cpu_times()[:2]) - before
    client.close()
    return float(1e6 * used_s / beats)


def cpu_per_report_us(url: str, server: psutil.Process, reports: int) -> float:
    """Server CPU per node agent report (one GPU), spaced as the heartbeats are."""
    body = {"node": "n1", "sampled_at_s": 0.0, "source": "inject", "gpus": [
        {"node": "n1", "index": 0, "temperature_c": 40.0, "memory_used_mb": 0, "memory_total_mb": 80000}]}
    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        client.post(url + "/agent/report", json=body).raise_for_status()
        before = sum(server.cpu_times()[:2])
        start = time.monotonic()
        for i in range(reports):
            time.sleep(max(0.0, start + i / RATE_PER_S - time.monotonic()))
            client.post(url + "/agent/report", json={**body, "sampled_at_s": float(i)}).raise_for_status()
        return float(1e6 * (sum(server.cpu_times()[:2]) - before) / reports)


def report_cost(reports: int, runs: int) -> dict[str, float]:
    """CPU per agent report: the fast path against the FastAPI route, interleaved runs."""
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        for name, fast in (("route", False), ("fast path", True)):
            ready: Queue[Any] = mp.Queue()
            done: Queue[Any] = mp.Queue()
            process = mp.Process(target=serve_ours, args=(ready, done, fast))
            process.start()
            url, _worker_id = ready.get(timeout=120)
            samples.setdefault(name, []).append(cpu_per_report_us(url, psutil.Process(process.pid), reports))
            done.put(None)
            process.join(10)
            process.kill()
    return {name: median(values) for name, values in samples.items()}


def measure(beats: int, runs: int) -> dict[tuple[str, str], float]:
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(runs):
        for name, target in (("bare uvicorn app", serve_bare), ("controller", serve_ours)):
            ready: Queue[Any] = mp.Queue()
            done: Queue[Any] = mp.Queue()
            process = mp.Process(target=target, args=(ready, done))
            process.start()
            url, worker_id = ready.get(timeout=120)
            for pattern in PATTERNS:
                samples.setdefault((name, pattern), []).append(
                    cpu_per_beat_us(pattern, url, worker_id, psutil.Process(process.pid), beats))
            done.put(None)
            process.join(10)
            process.kill()
    return {key: median(values) for key, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--beats", type=int, default=400, help="heartbeats per pattern and run")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    cost = measure(args.beats, args.runs)
    reports = report_cost(args.beats, args.runs)
    rows = [f"| {p} | {cost['controller', p]:.0f} us | {cost['bare uvicorn app', p]:.0f} us | "
            f"{cost['controller', p] / cost['bare uvicorn app', p]:.2f}x |" for p in PATTERNS]
    at_256 = {name: cost[name, PATTERNS[0]] * RATE_PER_S / 1e4 for name in ("controller", "bare uvicorn app")}
    write_report("heartbeat_cost", "\n".join([
        "## Server CPU per worker heartbeat (user + system of the server process)", "",
        f"{args.beats} heartbeats per pattern, spaced at {RATE_PER_S:.1f}/s (256 workers every 5 s), medians of "
        f"{args.runs} interleaved runs; the client is the worker step's own.", "",
        "| pattern | controller | bare uvicorn app (same run) | ratio |", "|---|---|---|---|", *rows, "",
        f"At 256 workers ({RATE_PER_S:.1f} heartbeats/s, spaced): {at_256['controller']:.1f} % of a core for the "
        f"controller's heartbeats, {at_256['bare uvicorn app']:.1f} % for the bare app.", "",
        f"A node agent's report (one GPU), spaced the same: {reports['fast path']:.0f} us on the fast path, "
        f"{reports['route']:.0f} us through the FastAPI route (the fast path off, same run): "
        f"{reports['fast path'] / reports['route']:.2f}x.", ""]))
    write_headline("heartbeat_cost", [(
        "server CPU per heartbeat at 256 workers' rate, kept alive",
        f"{cost['controller', PATTERNS[0]]:.0f} us ({at_256['controller']:.1f} % of a core at 51/s)",
        f"bare uvicorn app {cost['bare uvicorn app', PATTERNS[0]]:.0f} us",
        f"{cost['controller', PATTERNS[0]] / cost['bare uvicorn app', PATTERNS[0]]:.2f}x")])


if __name__ == "__main__":
    main()
