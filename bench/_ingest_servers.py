"""The ingest bench's servers (ours and Atropos, one process each) and wrk, the load generator driving them."""

from __future__ import annotations

import json
import resource
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from slurm_elastic.rollouts.wire import pack_group

TOKENS = 512
GROUP = 8
BATCH_SEQS = 32
EMPTY_BATCH_SEQS = 4096  # the load runs' servers: emptied in batches this large (a few acks, not thousands)
TOKEN = "bench-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

_TOKEN_IDS = list(range(1000, 1000 + TOKENS))
_GROUP = {"worker_id": "0001", "policy_version": 0, "group_size": GROUP,
          "sequences": [{"tokens": _TOKEN_IDS, "mask": [1] * TOKENS, "score": 0.5}] * GROUP}
BODY_TAIL = {  # the body after '{"id":"...",' (ours: a unique id per group makes each submit a new group)
    "sdk": json.dumps(pack_group(_GROUP), separators=(",", ":"))[1:],
    "lists": json.dumps(_GROUP, separators=(",", ":"))[1:],
}
ATROPOS_BODY = json.dumps({"tokens": [_TOKEN_IDS] * GROUP, "masks": [[1] * TOKENS] * GROUP,
                           "scores": [0.5] * GROUP}, separators=(",", ":"))

WRK_SCRIPT = """
local prefix, path, tail
local counter = 0
init = function(args)
  prefix, path = args[2], args[3]
  local f = io.open(args[1]); tail = f:read("*a"); f:close()
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  wrk.headers["Authorization"] = "Bearer @TOKEN@"
end
request = function()
  counter = counter + 1
  if prefix == "-" then return wrk.format(nil, path, nil, tail) end
  return wrk.format(nil, path, nil, '{"id":"' .. prefix .. counter .. '",' .. tail)
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('RESULT {"requests":%d,"duration_us":%d,"non2xx":%d,"socket_errors":%d,'
    .. '"p50_us":%d,"p99_us":%d}\\n', summary.requests, summary.duration, e.status,
    e.connect + e.read + e.write + e.timeout, latency:percentile(50), latency:percentile(99)))
end
""".replace("@TOKEN@", TOKEN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """One server process: ours (fsync always/off) or Atropos."""

    name: str
    kind: str  # "ours" or "atropos"
    argv: list[str]
    body: str  # "sdk", "lists" or "atropos"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    state_dir: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def submit_path(self) -> str:
        return "/rollouts" if self.kind == "ours" else "/scored_data"

    def start(self) -> Server:
        argv = [*self.argv, "--port", str(self.port)]
        if self.kind == "ours":
            self.state_dir = tempfile.mkdtemp(prefix="se-ingest-", dir="/var/tmp")  # on disk: fsync is real
            argv += ["--dir", self.state_dir]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(self.url + ("/healthz" if self.kind == "ours" else "/"), timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit(f"{self.name}: the server did not start ({' '.join(argv)})") from None
                time.sleep(0.2)
        self.reset()
        return self

    def reset(self) -> None:
        """An empty queue. Atropos: emptied (it keeps everything in memory), a trainer registered.
        Ours: every batch pulled and acknowledged, as a trainer would."""
        if self.kind == "ours":
            left = httpx.post(self.url + "/bench/empty", headers=AUTH, timeout=600).json()["queued_sequences"]
            if left >= EMPTY_BATCH_SEQS:
                raise SystemExit(f"{self.name}: {left} sequences still queued after emptying")
        if self.kind == "atropos":
            httpx.get(self.url + "/reset_data", timeout=30)
            httpx.post(self.url + "/register", timeout=30, json={
                "wandb_group": "bench", "wandb_project": "bench", "batch_size": BATCH_SEQS,
                "max_token_len": 4096, "checkpoint_dir": "/tmp/atropos-ckpt", "save_checkpoint_interval": 10**6,
                "starting_step": 0, "num_steps": 10**6})

    @property
    def process(self) -> psutil.Process:
        assert self.proc is not None
        return psutil.Process(self.proc.pid)

    def processes(self) -> list[psutil.Process]:
        """The server and its helper processes (ours: the store's syncer)."""
        return [self.process, *self.process.children(recursive=True)]

    def cpu_s(self) -> float:
        return sum(float(t.user + t.system) for t in (p.cpu_times() for p in self.processes()))

    def rss_mb(self) -> float:
        return sum(float(p.memory_info().rss) for p in self.processes()) / 2**20

    def disk_bytes(self) -> int:
        """Disk the server's queue takes (blocks allocated under its state directory; Atropos: none)."""
        if not self.state_dir:
            return 0
        return sum(p.stat().st_blocks * 512 for p in Path(self.state_dir).rglob("*") if p.is_file())

    def queued_groups(self) -> int:
        if self.kind == "ours":
            return int(httpx.get(self.url + "/global-status", headers=AUTH, timeout=30).json()["queue"]["queued_groups"])
        return int(httpx.get(self.url + "/status", timeout=30).json()["queue_size"])

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)


@dataclass
class LoadResult:
    seqs_per_s: float
    p50_ms: float
    p99_ms: float
    server_cpu_pct: float
    client_cpu_pct: float
    failed: int


class Wrk:
    """Runs wrk against a server with that server's body; ids unique across runs."""

    def __init__(self, workdir: Path) -> None:
        if shutil.which("wrk") is None:
            raise SystemExit("this benchmark drives the servers with wrk: apt-get install wrk")
        self.workdir = workdir
        self.script = workdir / "submit.lua"
        self.script.write_text(WRK_SCRIPT)
        for name, tail in [*BODY_TAIL.items(), ("atropos", ATROPOS_BODY)]:
            (workdir / f"{name}.json").write_text(tail)
        self.runs = 0

    def run(self, server: Server, connections: int, seconds: float) -> LoadResult:
        self.runs += 1
        prefix = "-" if server.kind == "atropos" else f"r{self.runs}-"
        argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "30s", "-s", str(self.script),
                server.url, "--", str(self.workdir / f"{server.body}.json"), prefix, server.submit_path]
        client0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        server0, t0 = server.cpu_s(), time.perf_counter()
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        elapsed = time.perf_counter() - t0
        server_cpu = server.cpu_s() - server0
        client1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        client_cpu = (client1.ru_utime - client0.ru_utime) + (client1.ru_stime - client0.ru_stime)
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        r = json.loads(line.removeprefix("RESULT "))
        ok = r["requests"] - r["non2xx"]
        return LoadResult(ok * GROUP / (r["duration_us"] / 1e6), r["p50_us"] / 1e3, r["p99_us"] / 1e3,
                          100 * server_cpu / elapsed, 100 * client_cpu / elapsed, r["non2xx"] + r["socket_errors"])
