"""What `./run example` runs: the elastic RL example on the local dev cluster, narrated.

It submits examples/elastic_rl.sbatch, watches the job through `slurm-elastic status --json`,
cordons a GPU and kill -9s the controller part-way through (the batch script restarts it), and
prints what happened: the reward curve, how the worker count followed the trainer, and that
no worker was relaunched and no rollout lost.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from slurm_elastic.controller.config import load_config

REPO = Path(__file__).resolve().parents[1]
GROUP_SIZE = int(load_config(REPO / "examples" / "elastic.toml").workers.env["GROUP_SIZE"])
STALE_IN_LAST_LINE = re.compile(r"^worker \d+: drained after \d+ groups: \d+ stored.*?, (\d+) stale")


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, cwd=REPO).stdout


def status(job_id: int) -> dict[str, Any] | None:
    out = subprocess.run(["slurm-elastic", "status", str(job_id), "--json"], capture_output=True, text=True)
    try:
        doc = json.loads(out.stdout)
    except ValueError:
        return None
    return doc if doc.get("controller_reachable") else None


def job_running(job_id: int) -> bool:
    return bool(sh("squeue", "-h", "-j", str(job_id), "-o", "%T").strip())


def main() -> int:
    job_id = int(sh("sbatch", "--parsable", "examples/elastic_rl.sbatch").strip().split(";")[0])
    print(f"submitted job {job_id}: the controller, a trainer step, and elastic rollout workers")
    cordoned = killed = False
    cordoned_at, cordoned_node = float("inf"), ""
    killed_pid = 0
    targets: list[int] = []
    active_seen: list[int] = []
    last_line = ""
    doc: dict[str, Any] | None = None
    last_queue: dict[str, Any] = {}
    while job_running(job_id):
        doc = status(job_id) or doc
        if doc is None:
            time.sleep(1.0)
            continue
        ctl = doc["controller"]
        queue = _queue(job_id)
        last_queue = queue or last_queue
        version = queue.get("policy_version", 0) if queue else 0
        active = ctl["workers_by_state"]["ACTIVE"]  # placeholders are counted apart
        targets.append(ctl["target_workers"])
        active_seen.append(active)
        action, reason = ctl["last_decision"].get("action", ""), ctl["last_decision"].get("reason", "")
        said = reason if reason.startswith(f"{action}:") else f"{action}: {reason}"  # a hold's reason says "hold:"
        line = (f"  v{version:<3} workers {active} (target {ctl['target_workers']})  buffer "
                f"{queue.get('queued_sequences', '?')}  {said[:100]}")
        if line != last_line:
            print(line, flush=True)
            last_line = line
        if not cordoned and version >= 8:
            cordoned_node = last_node(job_id)
            sh("slurm-elastic", "cordon", str(job_id), f"{cordoned_node}:3", "--reason", "example: operator cordon")
            print(f"  >> cordoned {cordoned_node}:3 (no new worker will be placed there)")
            cordoned, cordoned_at = True, time.time()
        if not killed and version >= 18:
            info = json.loads((Path(_state_dir(job_id)) / "controller.json").read_text())
            killed_pid = int(info["pid"])
            os.kill(killed_pid, signal.SIGKILL)
            print(f"  >> kill -9 of the controller (pid {killed_pid}); the batch script restarts it")
            killed = True
        time.sleep(1.0)
    return summarize(job_id, cordoned_at, cordoned_node, targets, active_seen, killed, last_queue)


def last_node(job_id: int) -> str:
    """The last of the job's nodes (node2 on the dev cluster), the one whose GPU 3 is cordoned."""
    return sh("scontrol", "show", "hostnames", sh("squeue", "-h", "-j", str(job_id), "-o", "%N").strip()).split()[-1]


def _state_dir(job_id: int) -> str:
    from slurm_elastic.client.locate import locate

    return str(locate(job_id).state_dir)


def _queue(job_id: int) -> dict[str, Any]:
    from slurm_elastic.client.control import ControlClient
    from slurm_elastic.client.locate import locate
    from slurm_elastic.errors import SlurmElasticError

    try:
        handle = locate(job_id)
        with ControlClient(handle.url, handle.token) as client:
            return dict(client.global_status()["queue"])
    except (SlurmElasticError, KeyError):
        return {}


def refused_stale_by_worker_logs(state_dir: Path) -> int:
    """Groups the store refused as stale, by every worker's last line (`worker 0003: drained after 41
    groups: 38 stored, 3 stale`): the controller's own count starts again at its restart."""
    lines = (line for log in sorted((state_dir / "logs").glob("worker-*.out"))
             for line in log.read_text(errors="replace").splitlines())
    return sum(int(m.group(1)) for line in lines if (m := STALE_IN_LAST_LINE.search(line)))


def summarize(job_id: int, cordoned_at: float, cordoned_node: str, targets: list[int], active: list[int],
              killed: bool, queue: dict[str, Any]) -> int:
    state_dir = Path(_state_dir(job_id))
    rows = [line.split(",") for line in (state_dir / "reward.csv").read_text().splitlines()[1:]]
    rewards = [float(r[2]) for r in rows]
    records = json.loads((state_dir / "state.json").read_text())["state"]["workers"].values()
    relaunched = [w["worker_id"] for w in records if w["launches"] > 1]
    placed_on_cordoned = [w for w in records if w["node"] == cordoned_node and 3 in w["gpus"] and not w["placeholder"]
                          and any(h[2] == "ACTIVE" and h[0] > cordoned_at for h in w["history"])]
    print(f"\njob {job_id} finished: {len(rows)} training steps")
    print(f"  reward: {rewards[0]:.3f} at the start -> {max(rewards[-5:]):.3f} at the end (chance: 0.062)")
    print(f"  workers: from {min(active)} up to {max(active)} and back; targets seen {sorted(set(targets))}")
    print(f"  controller killed: {'yes, and restarted' if killed else 'no'}; workers relaunched: {len(relaunched)}")
    print(f"  workers placed on the cordoned GPU after the cordon: {len(placed_on_cordoned)}")
    if queue:  # the last reading before the job ended: the store's counts, which survive the controller's kill
        delivered, dropped, lost = queue["delivered_sequences"], queue["dropped_stale_sequences"], queue["lost_sequences"]
        refused = refused_stale_by_worker_logs(state_dir) * GROUP_SIZE  # the controller counts only since its restart
        made = delivered + dropped + refused
        print(f"  sequences: {delivered} trained on, {dropped} dropped stale in the buffer, {refused} refused stale "
              f"at submit ({(dropped + refused) / max(1, made):.0%} of those made too old), {lost} lost")
    print(f"  plot: {state_dir / 'reward.png'}  log: {REPO / f'elastic-rl-{job_id}.out'}")
    ok = rewards[-1] > rewards[0] + 0.2 and max(active) > min(active) and not relaunched and not placed_on_cordoned
    print("example: OK" if ok else "example: something did not go as expected (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
