"""Bad input, tried for real against a live controller on the dev cluster, the CLI, the state
file, the config, and Slurm itself. Each probe does one wrong thing and records what came back
and the evidence that nothing was lost.

Used by tests/cluster/test_bad_input.py (every probe must hold) and bench/bench_bad_input.py
(which writes the table that docs/bad-input.md shows).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec
from slurm_elastic.errors import EXIT_CONFIG
from slurm_elastic.slurm.cli_backend import SlurmCli
from tests.cluster.controller_harness import (
    ControllerJob,
    locate_in,
    start_controller_job,
    stop_controller_job,
    wait_for,
)

QUEUE = {"batch_size": 8, "capacity_seqs": 64, "max_group_bytes": 200_000}


@dataclass(frozen=True)
class Probe:
    """One bad input: what was tried, what came back, what shows that nothing was lost."""

    area: str
    tried: str
    got: str
    kept: str
    ok: bool


def group(gid: str, n: int = 4) -> dict[str, Any]:
    return {"id": gid, "worker_id": "0001", "policy_version": 0, "group_size": n,
            "sequences": [{"tokens": [1, 2, 3, 4], "mask": [1, 1, 1, 1], "score": 0.5} for _ in range(n)]}


def short(text: str, limit: int = 110) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cli(*args: str, env: dict[str, str] | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """``slurm-elastic ARGS`` as a user runs it (a fresh process, this environment)."""
    return subprocess.run([sys.executable, "-m", "slurm_elastic", *args], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **(env or {})})


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in (result.stderr + result.stdout).splitlines() if "error" in ln.lower()]
    return short(lines[-1] if lines else (result.stderr or result.stdout))


class Rig:
    """A live controller job with two workers running and one group queued."""

    def __init__(self, job: ControllerJob) -> None:
        self.job = job
        self.url, self.token = locate_in(job.state_dir, job.job_id)
        self.auth = {"Authorization": f"Bearer {self.token}"}
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def prepare(self) -> None:
        self.post("/admin/scale", {"workers": 2}).raise_for_status()
        self.job.active(2)
        self.post("/rollouts", group("kept-1")).raise_for_status()

    def post(self, path: str, body: Any = None, *, content: bytes | None = None,
             headers: dict[str, str] | None = None) -> httpx.Response:
        return self.http.post(path, json=body if content is None else None, content=content,
                              headers=self.auth if headers is None else headers)

    def snapshot(self) -> dict[str, Any]:
        """What must not change: queued sequences, the worker steps Slurm runs, the target."""
        status = self.http.get("/global-status", headers=self.auth).json()
        return {"queued": status["queue_size"], "steps": self.job.worker_steps(),
                "target": self.http.get("/controller/status", headers=self.auth).json()["target_workers"]}

    def kept(self, before: dict[str, Any]) -> tuple[str, bool]:
        after = self.snapshot()
        same = after == before
        text = (f"queue {after['queued']} seqs, {len(after['steps'])} worker steps, target {after['target']}: "
                + ("unchanged" if same else f"CHANGED from {before}"))
        return text, same

    def close(self) -> None:
        self.http.close()


def _api(rig: Rig, tried: str, send: Callable[[], httpx.Response], want: int, must_say: str = "") -> Probe:
    before = rig.snapshot()
    response = send()
    detail = response.text
    with_detail = not must_say or must_say in detail
    kept, same = rig.kept(before)
    got = f"{response.status_code}" + (f" {short(detail, 90)}" if detail else "")
    return Probe("HTTP API", tried, got, kept, response.status_code == want and with_detail and same)


def api_probes(rig: Rig) -> Iterator[Probe]:
    none: dict[str, str] = {}
    wrong = {"Authorization": "Bearer " + "0" * len(rig.token)}
    yield _api(rig, "submit without a token", lambda: rig.post("/rollouts", group("a"), headers=none), 401)
    yield _api(rig, "drain a worker with a wrong token", lambda: rig.post("/admin/drain/0001", headers=wrong), 403)
    yield _api(rig, "scale with a wrong token", lambda: rig.post("/admin/scale", {"workers": 0}, headers=wrong), 403)
    yield _api(rig, "submit a body that is not JSON", lambda: rig.post("/rollouts", content=b"{not json"), 422)
    yield _api(rig, "submit with `policy_version: \"x\"`",
               lambda: rig.post("/rollouts", {**group("b"), "policy_version": "x"}), 422, "policy_version")
    yield _api(rig, "submit `group_size: 3` with 4 sequences",
               lambda: rig.post("/rollouts", {**group("c"), "group_size": 3}), 422, "group_size")
    yield _api(rig, "submit a sequence without tokens",
               lambda: rig.post("/rollouts", {**group("d", 1), "sequences": [{"score": 1.0}]}), 422, "tokens")
    big = {**group("e"), "metadata": {"blob": "x" * 300_000}}
    yield _api(rig, "submit a 300 KB group (limit `queue.max_group_bytes` 200 KB)",
               lambda: rig.post("/rollouts", big), 413)
    huge = b'{"id":"f","blob":"' + b"x" * (64 * 2**20) + b'"}'
    yield _api(rig, "submit a 64 MiB body", lambda: rig.post("/rollouts", content=huge), 413)
    yield _api(rig, "scale to -1 workers", lambda: rig.post("/admin/scale", {"workers": -1}), 422, "workers")
    yield _api(rig, "scale to `\"many\"` workers", lambda: rig.post("/admin/scale", {"workers": "many"}), 422, "workers")
    yield _api(rig, "drain an unknown worker id", lambda: rig.post("/admin/drain/9999"), 404, "9999")
    yield _api(rig, "heartbeat from an unknown worker id",
               lambda: rig.post("/workers/9999/heartbeat", {"rollouts": 1}), 404, "9999")
    yield _api(rig, "drain `x y` (not a worker id)", lambda: rig.post("/admin/drain/x%20y"), 422, "worker_id")
    yield _api(rig, "acknowledge an unknown batch id",
               lambda: rig.post("/trainer/batch/" + "0" * 32 + "/ack"), 404)
    yield _api(rig, "cordon a GPU the job does not have",
               lambda: rig.post("/admin/cordon", {"node": "nowhere", "gpu": 99, "reason": "x"}), 404, "nowhere")
    yield _api(rig, "submit the queued group's id again (a retry)",
               lambda: rig.post("/rollouts", group("kept-1")), 200, '"accepted":false')
    yield _api(rig, "publish policy version 10^30", lambda: rig.post("/trainer/version", {"version": 10**30}),
               422, "version")
    yield _api(rig, "publish policy version 1000000 (a jump; not `recovered`)",
               lambda: rig.post("/trainer/version", {"version": 10**6}), 409, "recovered=true")
    yield _api(rig, "pull with a `trainer_session` no registration answered",
               lambda: rig.post(f"/trainer/batch?trainer_session={2**62}"), 409, "trainer session unknown")
    yield _api(rig, "ask admission without a `worker_id`",
               lambda: rig.post("/rollouts/admission", {"sequences": 4}), 422, "worker_id")
    yield from hostile_client_probes(rig)
    yield from loose_submit_probes(rig)
    yield from growth_probes(rig)
    yield from liveness_probes(rig)
    yield from weights_probes(rig)


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _huge_body_without_token(rig: Rig, path: str, total_bytes: int) -> tuple[bytes, int]:
    """POST ``total_bytes`` of body without a token (the head and 1 MB, a wait for an early
    answer, then the rest): the answer's status line and the MB sent before it."""
    chunk = b"x" * 2**20
    with socket.create_connection(_address(rig.url), timeout=60) as conn:
        sent, answer = 0, b""
        try:
            conn.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {total_bytes}\r\n\r\n".encode()
                         + chunk)
            sent = len(chunk)
            if select.select([conn], [], [], 10)[0]:
                answer = conn.recv(65536)
            while sent < total_bytes and not answer:
                conn.sendall(chunk)
                sent += len(chunk)
            answer = answer or conn.recv(65536)
        except OSError:  # the server answered and closed while we sent: its answer may wait unread
            with contextlib.suppress(OSError):
                answer = answer or conn.recv(65536)
    return answer.split(b"\r\n", 1)[0], sent // 2**20


def hostile_client_probes(rig: Rig) -> Iterator[Probe]:
    """A client without the token: big bodies, bad JSON, a request head that never ends."""
    before = rig.snapshot()
    rss_before = _controller_rss(rig)
    answers: list[tuple[bytes, int]] = []
    threads = [threading.Thread(target=lambda p=path: answers.append(_huge_body_without_token(rig, p, 100 * 2**20)))
               for path in ("/rollouts", "/agent/report", "/admin/scale")]
    for thread in threads:
        thread.start()
    healthz_ms: list[float] = []
    while any(t.is_alive() for t in threads):
        started = time.monotonic()
        rig.http.get("/healthz", headers=rig.auth).raise_for_status()
        healthz_ms.append((time.monotonic() - started) * 1000)
    for thread in threads:
        thread.join()
    growth_mb = (_controller_rss(rig) - rss_before) / 2**20
    kept, same = rig.kept(before)
    codes = sorted({a[0].decode(errors="replace").removeprefix("HTTP/1.1 ") for a in answers})
    yield Probe("HTTP API", "three 100 MB bodies at once without a token (submit, agent report, scale)",
                f"{', '.join(codes)} after {max(a[1] for a in answers)} MB sent; controller memory "
                f"{growth_mb:+.0f} MB; /healthz meanwhile: max {max(healthz_ms, default=0):.0f} ms",
                kept, same and len(answers) == 3 and codes == ["401 Unauthorized"] and growth_mb < 20)
    yield _api(rig, "submit a body that is not JSON, without a token",
               lambda: rig.post("/rollouts", content=b"{not json", headers={}), 401)
    yield _api(rig, "scale with a body that is not JSON, without a token",
               lambda: rig.post("/admin/scale", content=b"{not json", headers={}), 401)
    before = rig.snapshot()
    started = time.monotonic()
    closed_after_s = -1.0
    with socket.create_connection(_address(rig.url), timeout=60) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
        try:
            while time.monotonic() - started < 40:
                conn.sendall(b"x-slow: a\r\n")  # a header line a second, never the end of the head
                if select.select([conn], [], [], 1.0)[0] and conn.recv(1024) == b"":
                    break
            closed_after_s = time.monotonic() - started
        except OSError:
            closed_after_s = time.monotonic() - started
    kept, same = rig.kept(before)
    yield Probe("HTTP API", "a request head sent a line a second, never finished (slowloris)",
                f"connection closed after {closed_after_s:.0f} s", kept, same and 0 < closed_after_s < 30)


def _controller_rss(rig: Rig) -> int:
    return int(psutil.Process(rig.job.controller_pid()).memory_info().rss)


def _seq(**fields: Any) -> dict[str, Any]:
    return {"tokens": [1, 2, 3, 4], "mask": [1, 1, 1, 1], "score": 0.5, **fields}


def _raw_group(gid: str, sequence: str) -> bytes:
    """A group of 4 whose last sequence is ``sequence`` as written (JSON text, NaN and all)."""
    good = json.dumps(_seq())
    head = f'{{"id":"{gid}","worker_id":"0001","policy_version":0,"group_size":4,"sequences":['
    return (head + ",".join([good, good, good, sequence]) + "]}").encode()


def loose_submit_probes(rig: Rig) -> Iterator[Probe]:
    """Submits with values the trainer must never see, and one bad group among good ones."""
    seq = json.dumps(_seq())
    for tried, sequence, named in (
            ("score `NaN`", seq.replace("0.5", "NaN"), "score"),
            ("score `1e999`", seq.replace("0.5", "1e999"), "score"),
            ("score `\"1e3\"` (a string)", seq.replace("0.5", '"1e3"'), "score"),
            ("tokens as strings", seq.replace("[1, 2, 3, 4], \"mask", '["1", "2", "3", "4"], "mask'), "tokens"),
            ("tokens as booleans", seq.replace("[1, 2, 3, 4], \"mask", '[true, true, false, true], "mask'),
             "tokens"),
            ("5 logprobs for 4 tokens", json.dumps(_seq(logprobs=[-1.0] * 5)), "logprobs")):
        yield _api(rig, f"submit a sequence with {tried}",
                   lambda s=sequence: rig.post("/rollouts", content=_raw_group("loose", s)), 422, named)
    yield _api(rig, f"submit a group of 9 sequences (batch_size {QUEUE['batch_size']})",
               lambda: rig.post("/rollouts", group("nine", 9)), 422, "batch_size")
    before = rig.snapshot()
    bodies = [{**group(f"mixed-{i}"), "policy_version": 2**63 if i == 1 else 0} for i in range(3)]

    async def at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=rig.url, headers=rig.auth, timeout=30) as http:
            return list(await asyncio.gather(*(http.post("/rollouts", json=b) for b in bodies)))

    answers = asyncio.run(at_once())
    after = rig.snapshot()
    stored = after["queued"] - before["queued"]
    others_same = {k: v for k, v in after.items() if k != "queued"} == {k: v for k, v in before.items() if k != "queued"}
    codes = [a.status_code for a in answers]
    yield Probe("HTTP API", "three submits at once, one with `policy_version` 2^63",
                f"{codes[1]} {short(answers[1].text, 70)}; the other two: {codes[0]}, {codes[2]}",
                f"the two good groups stored ({stored} seqs more), steps and target unchanged",
                codes == [200, 422, 200] and "policy_version" in answers[1].text and stored == 8 and others_same)


def growth_probes(rig: Rig) -> Iterator[Probe]:
    """An authenticated client that registers made-up workers, floods load reports, or sends a
    cordon reason with terminal escape codes."""
    before = rig.snapshot()
    workers = sorted(w["worker_id"] for w in rig.http.get("/controller/status", headers=rig.auth).json()["workers"])
    codes = {rig.post(f"/workers/x{i:04d}/register", {"node": "node1", "gpus": [3], "step_id": "99"}).status_code
             for i in range(300)}
    for _ in range(3):  # ticks that would count them as crashes
        ticks = rig.job.status()["ticks"]
        wait_for(lambda t=ticks: rig.job.status()["ticks"] > t, 10, "a tick")  # type: ignore[misc]
    status = rig.http.get("/controller/status", headers=rig.auth).json()
    after = sorted(w["worker_id"] for w in status["workers"])
    kept, same = rig.kept(before)
    yield Probe("HTTP API", "register 300 worker ids the controller never launched", f"{sorted(codes)} each",
                f"worker table {after} ({'unchanged' if after == workers else 'CHANGED'}), "
                f"{len(status['cordoned_gpus'])} GPUs cordoned; {kept}",
                codes == {404} and after == workers and not status["cordoned_gpus"] and same)
    before = rig.snapshot()
    running = rig.http.get("/global-status", headers=rig.auth).json()["queue"]["running_rollouts"]
    phantom = rig.post("/rollouts/admission", {"sequences": 100_000, "worker_id": "9999"})
    running_after = rig.http.get("/global-status", headers=rig.auth).json()["queue"]["running_rollouts"]
    kept, same = rig.kept(before)
    yield Probe("HTTP API", "ask admission for 100,000 sequences as a worker id the controller never launched",
                f"{phantom.status_code} {phantom.text[:90]}",
                f"running rollouts {running} -> {running_after} (the real workers' own asks only); {kept}",
                phantom.status_code == 404 and "was not launched" in phantom.text
                and running_after - running < 100 and same)  # before: 200, the whole bound taken for 600 s
    before = rig.snapshot()
    codes = {rig.post("/endpoints/load", {"client_id": f"router-{i}", "outstanding": {"0001": 1}}).status_code
             for i in range(2000)}
    routers = rig.http.get("/endpoints", headers=rig.auth).json()["routers"]
    kept, same = rig.kept(before)
    yield Probe("HTTP API", "2000 load reports from new router ids", f"{sorted(codes)} each",
                f"{routers} router reports kept (cap 256, 10 s each); {kept}", codes == {200} and routers <= 256 and same)
    yield _api(rig, "cordon a GPU with terminal escape codes in the reason",
               lambda: rig.post("/admin/cordon", {"node": "node1", "gpu": 0, "reason": "\x1b[2J\x1b[31mpwned"}),
               422, "printable")


def liveness_probes(rig: Rig) -> Iterator[Probe]:
    """Heartbeats that claim failed liveness probes: a bad count is refused, and in a rollout job
    (liveness probes are for servers) a count drains nothing."""
    yield _api(rig, "heartbeat with `liveness_failures: -1`",
               lambda: rig.post("/workers/0001/heartbeat", {"liveness_failures": -1}), 422, "liveness_failures")
    yield _api(rig, "a rollout worker's heartbeat with `liveness_failures: 1000` (liveness is for servers)",
               lambda: rig.post("/workers/0001/heartbeat", {"liveness_failures": 1000}), 200, '"drain":false')


def weights_probes(rig: Rig) -> Iterator[Probe]:
    """The trainer's published weights are checked at the edge; a refused publish keeps nothing."""
    yield _api(rig, "publish weights with a newline in the path",
               lambda: rig.post("/trainer/version", {"version": 0, "weights": "/ckpt/a\nb"}), 422, "printable")
    yield _api(rig, "publish weights as a number", lambda: rig.post("/trainer/version", {"version": 0, "weights": 7}),
               422, "weights")


def cli_probes(rig: Rig) -> Iterator[Probe]:
    result = cli("status", "999999")
    yield Probe("CLI", "`slurm-elastic status 999999` (no such job)", f"exit {result.returncode}: {error_line(result)}",
                "nothing to lose", result.returncode == 1 and "999999" in result.stderr)
    before = rig.snapshot()
    result = cli("scale", str(rig.job.job_id), "--", "-3")
    kept, same = rig.kept(before)
    yield Probe("CLI", "`slurm-elastic scale JOB -3`", f"exit {result.returncode}: {error_line(result)}", kept,
                result.returncode == 2 and "-3" in result.stderr and same)
    before = rig.snapshot()
    pid = rig.job.controller_pid()
    os.kill(pid, signal.SIGSTOP)  # hung, not gone: its clients time out
    try:
        result = cli("status", str(rig.job.job_id))
    finally:
        os.kill(pid, signal.SIGCONT)
    lists_steps = all(name in result.stdout for name in before["steps"])
    first = next((ln for ln in result.stdout.splitlines() if "controller" in ln), result.stderr)
    kept, same = rig.kept(before)
    yield Probe("CLI", "`slurm-elastic status JOB` while the controller is hung (SIGSTOP)",
                f"exit {result.returncode}: {short(first, 80)}; lists the {len(before['steps'])} worker steps "
                f"Slurm still runs: {'yes' if lists_steps else 'NO'}",
                kept, result.returncode == 3 and lists_steps and same)


def config_probes(job: ControllerJob, tmp: Path) -> Iterator[Probe]:
    """Bad configurations of a controller for ``job`` (its nodes: 2 GPUs or more, fewer than 3)."""
    bad = tmp / "bad-types.toml"
    bad.write_text('[autoscaler]\nmax_workers = "lots"\n[workers]\nheartbeat_grace_s = "soon"\n')
    result = cli("controller", "--config", str(bad), env={"SLURM_JOB_ID": str(job.job_id)})
    yield Probe("config", "controller with `max_workers = \"lots\"`, `heartbeat_grace_s = \"soon\"`",
                f"exit {result.returncode}: {error_line(result)}", "refused before touching Slurm or the state dir",
                result.returncode == EXIT_CONFIG and "heartbeat_grace_s" in result.stderr)
    bad.write_text('[autoscaler]\nmax_workers = "lots"\n')
    result = cli("controller", "--config", str(bad), env={"SLURM_JOB_ID": str(job.job_id)})
    yield Probe("config", "controller with `[autoscaler] max_workers = \"lots\"`",
                f"exit {result.returncode}: {error_line(result)}", "refused before touching Slurm or the state dir",
                result.returncode == EXIT_CONFIG and "autoscaler.max_workers" in result.stderr)
    bad.write_text("[workers\ncommand = ")
    result = cli("controller", "--config", str(bad), env={"SLURM_JOB_ID": str(job.job_id)})
    yield Probe("config", "controller with a file that is not TOML", f"exit {result.returncode}: {error_line(result)}",
                "refused before touching Slurm", result.returncode == EXIT_CONFIG and "not valid TOML" in result.stderr)
    good = job.tmp / "elastic.toml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")}
    outside = subprocess.run([sys.executable, "-m", "slurm_elastic", "controller", "--config", str(good)],
                             capture_output=True, text=True, timeout=60, env=env)
    yield Probe("config", "controller started outside an allocation (no SLURM_JOB_ID)",
                f"exit {outside.returncode}: {error_line(outside)}", "nothing started",
                outside.returncode == EXIT_CONFIG and "SLURM_JOB_ID" in outside.stderr)
    result = cli("controller", "--config", str(good), env={"SLURM_JOB_ID": "999999"})
    yield Probe("config", "controller for a job Slurm does not know (SLURM_JOB_ID=999999)",
                f"exit {result.returncode}: {error_line(result)}", "nothing started",
                result.returncode == 1 and "999999" in result.stderr)
    bad.write_text("[queue]\nbatch_size = 8\ncapacity_seqs = 4\n")
    result = cli("controller", "--config", str(bad), env={"SLURM_JOB_ID": str(job.job_id)})
    yield Probe("config", "controller with `[queue] capacity_seqs = 4` below `batch_size = 8`",
                f"exit {result.returncode}: {error_line(result)}", "refused before touching Slurm or the state dir",
                result.returncode == EXIT_CONFIG and "capacity_seqs" in result.stderr and "batch_size" in result.stderr)
    bad.write_text("[workers]\ncommand = \"true\"\ngpus_per_worker = 3\n")  # the job's nodes have 2 GPUs each
    result = cli("controller", "--config", str(bad), env={"SLURM_JOB_ID": str(job.job_id)})
    yield Probe("config", "controller with `gpus_per_worker = 3` in a job of 2-GPU nodes",
                f"exit {result.returncode}: {error_line(result)}", "refused before the state dir is opened",
                result.returncode == EXIT_CONFIG and "gpus_per_worker = 3" in result.stderr and "2 GPUs" in result.stderr)
    bad.write_text('[workers]\ncommand = "python worker.py --gpu {gpu}"\n')  # {gpus} misspelt
    result = cli("controller", "--config", str(bad), env={"SLURM_JOB_ID": str(job.job_id)})
    yield Probe("config", "controller with `workers.command = \"python worker.py --gpu {gpu}\"` (`{gpus}` misspelt)",
                f"exit {result.returncode}: {error_line(result)}", "refused before touching Slurm or the state dir",
                result.returncode == EXIT_CONFIG and "unknown placeholder {gpu}" in result.stderr)
    yield from burst_config_probes(job.job_id, tmp)


BAD_BURST_TABLES = (  # (the [burst] lines, the key the error must name, what it must say)
    ("max_jobs = -1", "burst.max_jobs", "greater than or equal to 0"),
    ("max_jobs = 1\ngpus_per_job = 0", "burst.gpus_per_job", "greater than or equal to 1"),
    ('max_jobs = 1\nextra_sbatch_options = ["--job-name=mine"]', "burst.extra_sbatch_options", "override --job-name"),
    ('max_jobs = 1\nextra_sbatch_options = ["--comm=mine"]', "burst.extra_sbatch_options", "override --comment"),
    ('max_jobs = 1\nextra_sbatch_options = ["--signal=KILL@1"]', "burst.extra_sbatch_options", "override --signal"),
    ('max_jobs = 1\nextra_sbatch_options = ["--constraint=a100\\nrm -rf ~"]', "burst.extra_sbatch_options",
     "not an sbatch option"),
    ('max_jobs = 1\npartition = "debug\\n#SBATCH --job-name=x"', "burst.partition", "not a Slurm name"),
    ('max_jobs = 1\ntime_limit = "2 hours"', "burst.time_limit", "not a Slurm time"),
)


def burst_config_probes(job_id: int, tmp: Path) -> Iterator[Probe]:
    """Bad ``[burst]`` tables: each refused at load (exit 78) naming the key, and no burst job submitted."""
    bad = tmp / "bad-burst.toml"
    for lines, key, says in BAD_BURST_TABLES:
        bad.write_text(f"[burst]\n{lines}\n")
        result = cli("controller", "--config", str(bad), env={"SLURM_JOB_ID": str(job_id)})
        burst_jobs = SlurmCli().list_jobs_named(f"elastic-burst-{job_id}")
        yield Probe("config", f"controller with `[burst] {'; '.join(lines.splitlines())}`",
                    f"exit {result.returncode}: {error_line(result)}",
                    f"refused before any burst job is submitted ({len(burst_jobs)} listed)",
                    result.returncode == EXIT_CONFIG and key in result.stderr and says in result.stderr
                    and not burst_jobs)


def state_probes(rig: Rig) -> Iterator[Probe]:
    for label, text in (("corrupt (not JSON)", "{half a fi"),
                        ("foreign (another job's)", json.dumps({"format": "slurm-elastic-controller-state",
                                                                "version": 1, "job_id": 1, "state": {}}))):
        wait_for(lambda: _quiet(rig), 60, "no worker starting or draining")  # else a launch in flight lands later
        before = rig.snapshot()
        old_pid = rig.job.controller_pid()
        state_file = rig.job.state_dir / "state.json"
        os.kill(old_pid, signal.SIGSTOP)  # no save can race the damage
        state_file.write_text(text)
        os.kill(old_pid, signal.SIGKILL)
        wait_for(lambda pid=old_pid: _restarted(rig, pid), 60, "the controller to restart")  # type: ignore[misc]
        _wait_for_the_same_steps(rig, before, 30)
        status = rig.http.get("/controller/status", headers=rig.auth).json()
        note = next((e["error"] for e in reversed(status["errors"]) if e.get("where") == "state"), "")
        moved = sorted(p.name for p in state_file.parent.glob("state.json.corrupt-*"))
        after = rig.snapshot()["steps"]
        relaunched = sum(1 for name, step in before["steps"].items() if after.get(name) != step)
        queued = rig.http.get("/global-status", headers=rig.auth).json()["queue_size"]
        ok = bool(note) and bool(moved) and relaunched == 0 and queued == before["queued"]
        yield Probe("state file", f"kill -9 the controller, leave a {label} state.json",
                    f"restart says: {short(note, 100)}",
                    f"same {len(before['steps'])} worker steps adopted, {relaunched} relaunched, "
                    f"queue {queued} seqs, bad file kept as {moved[-1] if moved else '?'}", ok)
    yield wrong_types_probe(rig)


def wrong_types_probe(rig: Rig) -> Probe:
    """Valid JSON, wrong types: what validates is kept (the manual target), the rest is said."""
    rig.post("/admin/scale", {"workers": 2}).raise_for_status()  # an operator's target to keep
    rig.job.status()
    ticks = rig.job.status()["ticks"]
    wait_for(lambda: rig.job.status()["ticks"] > ticks + 1, 10, "the scale to be saved")
    wait_for(lambda: _settled(rig, 2), 60, "two ACTIVE workers and no other worker step")
    before = rig.snapshot()
    old_pid = rig.job.controller_pid()
    state_file = rig.job.state_dir / "state.json"
    os.kill(old_pid, signal.SIGSTOP)
    doc = json.loads(state_file.read_text())
    first = sorted(doc["state"]["workers"])[0]
    doc["state"]["workers"][first]["state"] = "ZOMBIE"
    doc["state"].update(next_number="x", target_workers=None)
    state_file.write_text(json.dumps(doc))
    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: _restarted(rig, old_pid), 60, "the controller to restart")
    _wait_for_the_same_steps(rig, before, 60)
    status = rig.http.get("/controller/status", headers=rig.auth).json()
    notes = status["state_notes"]
    after = rig.snapshot()
    relaunched = sum(1 for name, step in before["steps"].items() if after["steps"].get(name) != step)
    ok = (len(notes) >= 3 and status["manual_target"] == before["target"] and relaunched == 0
          and after["queued"] == before["queued"] and not [e for e in status["errors"] if e["where"] == "tick"])
    return Probe("state file", "kill -9 the controller, leave a state.json with an unknown worker state, "
                 "`next_number: \"x\"`, `target_workers: null`",
                 f"restart says ({len(notes)} notes): {short(notes[0] if notes else '', 90)}",
                 f"manual target {status['manual_target']} kept, same {len(before['steps'])} worker steps adopted, "
                 f"{relaunched} relaunched, queue {after['queued']} seqs, no failed tick", ok)


def identity_probe(cluster: DevCluster, tmp: Path) -> Probe:
    """A new job whose state directory holds an earlier job's with the same id (ids restart after a
    reinstall): that directory is moved aside whole and the job starts clean, with a note."""
    old_note: dict[str, Any] = {}

    def leave_an_earlier_jobs_dir(job_id: int) -> None:
        state_dir = tmp / f"state-{job_id}"
        state_dir.mkdir(parents=True)
        (state_dir / "job.json").write_text(json.dumps({"format": "slurm-elastic-job", "cluster": cluster.spec.cluster_name,
                                                        "job_id": job_id, "submit_time_s": 1_600_000_000}))
        (state_dir / "token").write_text("the-earlier-jobs-token\n")
        (state_dir / "state.json").write_text(json.dumps({
            "format": "slurm-elastic-controller-state", "version": 1, "job_id": job_id,
            "state": {"workers": {}, "next_number": 40, "target_workers": 3, "manual_target": 3, "paused": True,
                      "wake_all_active": False}}))
        old_note["files"] = sorted(p.name for p in state_dir.iterdir())

    job = start_controller_job(cluster, tmp, nodes=1, gpus_per_node=1, autoscaler={"enable_elastic": False},
                               before_start=leave_an_earlier_jobs_dir)
    try:
        status = job.status()
        note = next((n for n in status["state_notes"] if "starts clean" in n), "")
        aside = sorted(p for p in tmp.glob(f"state-{job.job_id}.stale-*"))
        kept_old = bool(aside) and sorted(p.name for p in aside[0].iterdir()) == old_note["files"]
        record = json.loads((job.state_dir / "job.json").read_text())
        submit = SlurmCli().job_info(job.job_id).submit_time_s
        table = cli("status", str(job.job_id))
        clean = status["manual_target"] is None and not status["paused"] and job.worker_steps() == {}
        ok = (bool(note) and kept_old and clean and record["submit_time_s"] == submit
              and "saved state: state directory" in table.stdout and table.returncode == 0)
        return Probe("state file", "a new job finds an earlier job's state directory under its id (ids restart "
                     "after a reinstall; submit time differs)", f"starts clean and says: {short(note, 110)}",
                     f"the earlier job's {len(old_note['files'])} files kept whole in {aside[0].name if aside else '?'}; "
                     f"`status JOB` shows the note: {'yes' if 'saved state:' in table.stdout else 'NO'}", ok)
    finally:
        stop_controller_job(job)


def _settled(rig: Rig, workers: int) -> bool:
    """``workers`` ACTIVE workers, and no other worker step left in Slurm."""
    active = [w for w in rig.job.status()["workers"] if w["state"] == "ACTIVE" and not w.get("placeholder")]
    return len(active) == workers and len(rig.job.worker_steps()) == workers


def _wait_for_the_same_steps(rig: Rig, before: dict[str, Any], timeout_s: float) -> None:
    """Until Slurm lists the worker steps of ``before`` again; else fail naming both and the workers."""
    try:
        wait_for(lambda: rig.snapshot()["steps"] == before["steps"], timeout_s, "the same steps")
    except AssertionError as exc:
        workers = [(w["worker_id"], w["state"], w["step_id"], w["history"][-3:]) for w in rig.job.status()["workers"]]
        log = (rig.job.tmp / "job.out").read_text().splitlines()[-12:]
        raise AssertionError(f"{exc}: before {before['steps']}, now {rig.snapshot()['steps']}, workers {workers}; "
                             "job.out ends:\n" + "\n".join(log)) from None


def _quiet(rig: Rig) -> bool:
    """Every worker step Slurm runs is an ACTIVE worker's, and no worker is starting or draining."""
    workers = [w for w in rig.job.status()["workers"] if not w.get("placeholder")]
    active = [w for w in workers if w["state"] == "ACTIVE"]
    busy = [w for w in workers if w["state"] in ("STARTING", "DRAINING")]
    return not busy and len(rig.job.worker_steps()) == len(active)


def _restarted(rig: Rig, old_pid: int) -> bool:
    try:
        new_pid = rig.job.controller_pid()
        return new_pid != old_pid and rig.http.get("/healthz", headers=rig.auth).status_code == 200
    except (OSError, ValueError, httpx.HTTPError):
        return False


@contextmanager
def scratch_cluster(directory: Path) -> Iterator[DevCluster]:
    """A one-node cluster of its own (its slurmctld is stopped on purpose), taken down afterwards."""
    cluster = DevCluster(DevClusterSpec(dir=directory, nodes=1, gpus_per_node=2, ctld_port=22817,
                                        node_base_port=22901, cluster_name="badinput", node_prefix="bi",
                                        first_job_id=3_000_000))
    cluster.up(wait_s=90)
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf_path)
    try:
        yield cluster
    finally:
        if saved is not None:
            os.environ["SLURM_CONF"] = saved
        cluster.down()


def _observe_errors(job: ControllerJob) -> list[str]:
    """The controller's recorded listing failures, each cut to its cause."""
    return [e["error"].split("): ", 1)[-1] for e in job.status()["errors"] if e["where"] == "observe"]


def _named(steps: dict[str, str]) -> str:
    return ", ".join(f"{name} (step {step})" for name, step in steps.items())


def scratch_cluster_probes(tmp: Path) -> Iterator[Probe]:
    """On a one-node cluster of their own (they need no other, so they run beside the tests that
    share the dev cluster): bad configurations of a controller for a job there, then Slurm
    failing under that running controller: slurmctld hung (calls time out), then gone (refused)."""
    with scratch_cluster(tmp / "cluster") as cluster:
        job = start_controller_job(cluster, tmp / "job", nodes=1, gpus_per_node=2,
                                   controller={"slurm_timeout_s": 2.0}, autoscaler={"enable_elastic": False},
                                   workers={"initial_workers": 1, "heartbeat_grace_s": 60.0})
        home = tmp / "home"  # `status JOB` finds the state directory without asking Slurm
        (home / "jobs" / cluster.spec.cluster_name).mkdir(parents=True, exist_ok=True)
        (home / "jobs" / cluster.spec.cluster_name / str(job.job_id)).symlink_to(job.state_dir)
        status_env = {"SLURM_ELASTIC_HOME": str(home)}
        try:
            yield from config_probes(job, tmp)
            job.active(1)
            steps = job.worker_steps()
            ctld = cluster.daemon_pid("slurmctld")
            assert ctld is not None
            os.kill(ctld, signal.SIGSTOP)
            try:
                errors = wait_for(lambda: _observe_errors(job), 30, "the controller to notice")
                result = cli("status", str(job.job_id), "--json", env=status_env, timeout_s=120)
            finally:
                os.kill(ctld, signal.SIGCONT)
            doc = json.loads(result.stdout) if result.returncode == 0 else {}
            answered = bool(doc) and doc["controller"]["workers_by_state"]["ACTIVE"] == 1
            wait_for(lambda: job.worker_steps() == steps, 30, "Slurm to answer again")
            ticks = job.status()["ticks"]
            wait_for(lambda: job.status()["ticks"] > ticks, 30, "ticks to go on")
            relaunched = sum(w["launches"] for w in job.status()["workers"]) - 1
            yield Probe("Slurm", "slurmctld hung (SIGSTOP) under a running controller",
                        f"each tick's `squeue` fails or hits `slurm_timeout_s` (2 s), and is recorded: "
                        f"`{short(errors[-1], 80)}`; `status JOB` exit {result.returncode}, job_state "
                        f"{doc.get('job_state')}, slurm_error set: {bool(doc.get('slurm_error'))}",
                        f"worker {_named(steps)} kept, {relaunched} relaunched; ticks resume",
                        answered and relaunched == 0 and doc.get("job_state") == "UNKNOWN")
            ctld = cluster.daemon_pid("slurmctld")
            assert ctld is not None
            seen = len(_observe_errors(job))
            os.kill(ctld, signal.SIGKILL)
            wait_for(lambda: cluster.daemon_pid("slurmctld") is None, 10, "slurmctld to die")
            refused = wait_for(lambda: _observe_errors(job)[seen:], 30, "a failed squeue")
            result = cli("status", str(job.job_id), env=status_env, timeout_s=120)
            cluster.up(wait_s=90)
            wait_for(lambda: job.worker_steps() == steps, 60, "the step after slurmctld restarts")
            relaunched = sum(w["launches"] for w in job.status()["workers"]) - 1
            yield Probe("Slurm", "slurmctld killed, then started again",
                        f"recorded: `{short(refused[-1], 80)}`; `status JOB` exit {result.returncode}, "
                        f"`{short(result.stdout.splitlines()[0] if result.stdout else result.stderr, 90)}`",
                        f"worker {_named(steps)} survives and is adopted again, {relaunched} relaunched",
                        result.returncode == 0 and relaunched == 0)
        finally:
            stop_controller_job(job)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    missing = subprocess.run([sys.executable, "-m", "slurm_elastic", "status", "1"], capture_output=True, text=True,
                             timeout=60, env=env)
    yield Probe("Slurm", "Slurm's commands not on PATH", f"exit {missing.returncode}: {error_line(missing)}",
                "nothing to lose", missing.returncode == 1 and "PATH" in missing.stderr)


def _flip_a_byte(state_dir: Path, group_id: str) -> None:
    """Damage a stored group's body on disk (one bit of one byte)."""
    with sqlite3.connect(f"file:{state_dir / 'rollouts.sqlite'}?mode=ro", uri=True) as db:
        segment, offset = db.execute("SELECT segment, body_offset FROM groups WHERE id=?", (group_id,)).fetchone()
    with open(state_dir / "rollouts.segments" / f"{segment:08d}.log", "r+b") as f:
        f.seek(offset + 20)
        byte = f.read(1)
        f.seek(offset + 20)
        f.write(bytes([byte[0] ^ 1]))


def _syncer_of(pid: int) -> int | None:
    """The rollout store's syncer process started by ``pid``."""
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"rollouts.syncer" in (proc / "cmdline").read_bytes():
                return int(proc.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


def _empty_queue(rig: Rig) -> None:
    """Pull and acknowledge until fewer than a batch wait, then take the rest out with fillers."""
    for _ in range(100):
        pulled = rig.post("/trainer/batch")
        if pulled.status_code != 200:
            break
        rig.post(f"/trainer/batch/{pulled.json()['batch_id']}/ack").raise_for_status()
    waiting = rig.snapshot()["queued"]
    if waiting:  # fewer than a batch: fill up to one and pull it
        rig.post("/rollouts", group("filler-0", QUEUE["batch_size"] - waiting)).raise_for_status()
        batch = rig.post("/trainer/batch").json()
        rig.post(f"/trainer/batch/{batch['batch_id']}/ack").raise_for_status()


def storage_probes(rig: Rig) -> Iterator[Probe]:
    wait_for(lambda: _quiet(rig), 60, "no worker starting or draining")  # else a launch in flight lands later
    before = rig.snapshot()
    _empty_queue(rig)  # whatever earlier probes left queued: this probe's batch is its own groups
    for gid in ("fill-0", "dmg-1", "fill-1"):
        rig.post("/rollouts", group(gid)).raise_for_status()
    _flip_a_byte(rig.job.state_dir, "dmg-1")
    pulled = rig.post("/trainer/batch")
    batch = pulled.json() if pulled.status_code == 200 else {}
    ids = [g["id"] for g in batch.get("groups", [])]
    acked = rig.post(f"/trainer/batch/{batch['batch_id']}/ack").status_code if batch else 0
    for i in range(before["queued"] // 4):  # as much waiting again as before
        rig.post("/rollouts", group(f"kept-again-{i}")).raise_for_status()
    lost = rig.http.get("/global-status", headers=rig.auth).json()["queue"]["lost_groups"]
    kept, same = rig.kept(before)
    yield Probe("storage", "flip a byte in a queued group's record in the payload log, then pull a batch",
                f"{pulled.status_code}: groups {ids}, lost_group_ids {batch.get('lost_group_ids')}; "
                f"`/global-status` queue.lost_groups {lost}",
                f"{kept} (the damaged group never delivered, the others once)",
                pulled.status_code == 200 and ids == ["fill-0", "fill-1"] and batch.get("lost_group_ids") == ["dmg-1"]
                and acked == 200 and lost == 1 and same)

    wait_for(lambda: _quiet(rig), 60, "no worker starting or draining")
    before = rig.snapshot()
    old_pid = rig.job.controller_pid()
    syncer_pid = _syncer_of(old_pid)
    if syncer_pid is None:
        yield Probe("storage", "kill -9 the controller while its syncer is stopped", "no syncer found", "", False)
        return
    os.kill(syncer_pid, signal.SIGSTOP)  # a commit stalled on a slow disk
    os.kill(old_pid, signal.SIGKILL)
    log = rig.job.tmp / "job.out"
    line = ""
    try:
        wait_for(lambda: f"syncer pid {syncer_pid}" in log.read_text(), 60, "the new controller to wait")
        line = next(ln for ln in log.read_text().splitlines() if f"syncer pid {syncer_pid}" in ln)
        serving_meanwhile = _restarted(rig, old_pid)
    finally:
        os.kill(syncer_pid, signal.SIGCONT)
    wait_for(lambda: _restarted(rig, old_pid), 60, "the controller to restart")
    _wait_for_the_same_steps(rig, before, 30)
    kept, same = rig.kept(before)
    yield Probe("storage", "kill -9 the controller while its syncer is stopped (SIGSTOP), as on a hung disk",
                f"the new controller waits: `{short(line[line.find('waiting for'):], 100)}`; it serves once the old "
                "syncer is continued and exits",
                f"{kept}; nothing written while the old syncer lived",
                bool(line) and not serving_meanwhile and same)


def shared_cluster_probes(cluster: DevCluster, tmp: Path) -> list[Probe]:
    """The probes of a fresh controller job on ``cluster`` (the HTTP API, the CLI, its state)."""
    from tests.cluster.bad_input_more import audit_probes  # it imports this module
    probes: list[Probe] = []
    job = start_controller_job(cluster, tmp / "job", queue=QUEUE, autoscaler={"enable_elastic": False},
                               workers={"heartbeat_grace_s": 30.0})
    rig = Rig(job)
    try:
        rig.prepare()
        probes += api_probes(rig)
        probes += cli_probes(rig)
        probes += state_probes(rig)
        probes += storage_probes(rig)
        probes += audit_probes(rig)
    finally:
        rig.close()
        stop_controller_job(job)
    probes.append(identity_probe(cluster, tmp / "identity"))
    return probes


def run_all(cluster: DevCluster, tmp: Path) -> list[Probe]:
    """Every probe: those on ``cluster``, then those on a scratch cluster of their own."""
    return shared_cluster_probes(cluster, tmp) + list(scratch_cluster_probes(tmp / "scratch"))


def markdown(probes: list[Probe], tmp: Path | None = None) -> str:
    """The table; ``tmp`` (the run's scratch directory) is shown as ``$TMP``."""
    def clean(text: str) -> str:
        return (text.replace(str(tmp), "$TMP") if tmp else text).replace("|", "/")
    rows = ["| area | tried | got | lost nothing? | holds |", "|---|---|---|---|---|"]
    for p in probes:
        rows.append(f"| {p.area} | {clean(p.tried)} | {clean(p.got)} | {clean(p.kept)} | "
                    f"{'yes' if p.ok else '**NO**'} |")
    return "\n".join(rows) + "\n"
