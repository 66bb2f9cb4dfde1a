"""Server routing figures on the dev cluster: router overhead per request, and success through churn.

    ./run setup && .venv/bin/python bench/bench_router.py      # as root, dev cluster up; ~1 minute

Baseline in the same run: the same requests sent straight to one server with httpx (no router).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench._common import median, percentile, write_headline, write_report
from slurm_elastic.devcluster.cluster import DevCluster, default_dir
from slurm_elastic.router import Router
from tests.cluster.controller_harness import locate_in, start_controller_job, stop_controller_job
from tests.cluster.test_servers import FAKE_SERVER, Load

REQUESTS = 300
RUNS = 3


def main() -> None:
    cluster = DevCluster.at(default_dir())
    os.environ["SLURM_CONF"] = str(cluster.conf_path)
    with tempfile.TemporaryDirectory() as tmp:
        job = start_controller_job(
            cluster, Path(tmp), worker_env={"GEN_S": "0.0"},
            workers={"kind": "server", "command": [sys.executable, FAKE_SERVER, "{port}"], "readiness_path": "/health",
                     "server_drain_grace_s": 0.5, "drain_timeout_s": 20.0})
        try:
            with job.client() as c:
                c.scale(3)
            job.active(3)
            url, token = locate_in(job.state_dir, job.job_id)
            with Router(url, token, state_dir=job.state_dir, report_interval_s=0.2) as router:
                endpoints = router.wait_for_endpoints(3)
                direct_url = next(iter(endpoints.values()))
                direct_runs, routed_runs = [], []
                with httpx.Client() as direct:
                    for _ in range(RUNS):
                        direct_runs.append(_time(lambda i: direct.post(direct_url + "/generate", json={"id": i})))
                        routed_runs.append(_time(lambda i: router.request("POST", "/generate", json={"id": i})))
                d_med = median([median(r) for r in direct_runs])
                r_med = median([median(r) for r in routed_runs])
                r_p99 = median([percentile(r, 99) for r in routed_runs])
                d_p99 = median([percentile(r, 99) for r in direct_runs])
                # success through a scale-down and a server kill, under steady load
                with Load(router, threads=8, gen_s=0.2) as load:
                    time.sleep(2.0)
                    with job.client() as c:
                        c.scale(2)
                    time.sleep(2.0)
                    victim = next(e for e in job.events() if e["event"] == "start"
                                  and e["worker"] in router.endpoints())
                    os.kill(victim["pid"], signal.SIGKILL)
                    time.sleep(3.0)
                ok = sum(1 for _w, _t, good in load.results if good)
                stats = router.stats()
        finally:
            stop_controller_job(job)
    write_report("router", "\n".join([
        "## Server routing (dev cluster, 3 servers, empty replies)", "",
        "| figure | value |", "|---|---|",
        f"| direct httpx request, median / p99 ({RUNS} runs x {REQUESTS}) | {d_med * 1e3:.2f} ms / {d_p99 * 1e3:.2f} ms |",
        f"| through the router, median / p99 | {r_med * 1e3:.2f} ms / {r_p99 * 1e3:.2f} ms |",
        f"| router overhead per request (median) | {(r_med - d_med) * 1e6:.0f} us ({r_med / d_med:.2f}x) |",
        f"| success through a scale-down 3->2 and a server kill -9 under 8-way load | "
        f"{ok}/{len(load.results)} ({100 * ok / max(1, len(load.results)):.1f} %), {stats['retried']} retried |",
        "",
    ]))
    write_headline("router", [
        ("server router: time per request, median (vs direct httpx)", f"{r_med * 1e3:.2f} ms",
         f"{d_med * 1e3:.2f} ms", f"{r_med / d_med:.2f}x"),
        ("requests through a server scale-down and a server kill -9 (8-way load)",
         f"{ok}/{len(load.results)} succeeded", "", ""),
    ])


def _time(send) -> list[float]:  # type: ignore[no-untyped-def]
    samples = []
    for i in range(REQUESTS):
        t0 = time.perf_counter()
        reply = send(i)
        samples.append(time.perf_counter() - t0)
        assert reply.status_code == 200
    return samples




if __name__ == "__main__":
    main()
