"""Render a job's status (the controller's ``/global-status`` JSON) as a table a person reads at a glance.

Every string that reaches the terminal is printable: control and format characters from clients,
operators or a state file (terminal escape codes, newlines, bidi overrides) are shown escaped.
"""

from __future__ import annotations

from typing import Any

from slurm_elastic.errors import EXIT_CONFIG


def printable(text: str) -> str:
    """``text`` with every control or format character shown as its escape (``\\x1b``, ``\\u202e``)."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def _printable_tree(value: Any) -> Any:
    """``value`` with every string in it (keys too) made :func:`printable`."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(k) if isinstance(k, str) else k: _printable_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_printable_tree(v) for v in value]
    return value


def _age(seconds: Any) -> str:
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return "-"
    if s < 90:
        return f"{s:.0f}s"
    if s < 5400:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"  # a requeued job's time limit reads 365 days in Slurm: not 8760.0h


def _not_below_zero(seconds: Any) -> Any:
    """``seconds``, 0 if it is a number below 0 (a time limit just passed); anything else as it is."""
    return max(0.0, seconds) if isinstance(seconds, (int, float)) else seconds


def _cordons_by_cause(cordons: list[dict[str, Any]], now: float) -> dict[tuple[str, str, str, str], list[int]]:
    """The cordoned GPUs grouped by node, source, age and reason (a node Slurm takes out is one row)."""
    grouped: dict[tuple[str, str, str, str], list[int]] = {}
    for c in cordons:
        also = "".join(f"; also {o.get('source')}: {o.get('reason')}" for o in c.get("also") or [] if isinstance(o, dict))
        key = (str(c.get("node")), str(c.get("source", "")), _since(c.get("since_s"), now),
               str(c.get("reason", "")) + also)
        grouped.setdefault(key, []).append(int(c.get("gpu", 0)))
    return grouped


def _gpu_list(gpus: list[int]) -> str:
    """GPU indexes as runs: [0, 1, 2, 3, 6] -> "0-3,6"."""
    runs: list[list[int]] = []
    for gpu in sorted(gpus):
        if runs and gpu == runs[-1][-1] + 1:
            runs[-1].append(gpu)
        else:
            runs.append([gpu])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _where(worker: dict[str, Any]) -> str:
    """node:gpu,gpu of an ended worker ("-" if it never ran)."""
    if not worker.get("node"):
        return "-"
    gpus = ",".join(str(g) for g in worker.get("gpus") or [])
    return f"{worker['node']}:{gpus}" if gpus else str(worker["node"])


def _per_rollout(worker: dict[str, Any]) -> str:
    """Its mean seconds inside one rollout, "(slow)" when it drains first; "-" before 4 rollouts."""
    per_rollout_s = worker.get("seconds_per_rollout")
    if per_rollout_s is None:
        return "-"
    return f"{per_rollout_s:.1f}" + (" (slow)" if worker.get("slow") else "")


def _nodes_and_gpus(worker: dict[str, Any]) -> tuple[str, str]:
    """The NODE and GPU cells: every node of the step, and each node's GPUs joined by ``+`` (``?``:
    that node's task has not reported them yet)."""
    node = str(worker.get("node") or "")
    nodes = [n for n in worker.get("nodes") or [] if n] or ([node] if node else [])
    per_node = worker.get("node_gpus") or {}
    cells = [",".join(str(g) for g in (worker.get("gpus", []) if n == node else per_node.get(n, ["?"])))
             for n in nodes] or [",".join(str(g) for g in worker.get("gpus", []))]
    return ",".join(nodes) or "-", "+".join(cells) or "-"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line.rstrip()]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return out


RECENT_ERROR_S = 900.0  # the text status shows the errors of the last 15 minutes (--json: all it keeps)


def _recent(at_s: Any, now_s: float) -> bool:
    try:
        return now_s - float(at_s) <= RECENT_ERROR_S
    except (TypeError, ValueError):
        return True  # no time: shown


def _since(since_s: Any, now_s: float) -> str:
    try:
        return _age(now_s - float(since_s)) + " ago"
    except (TypeError, ValueError):
        return "-"


def _relaunched(worker: dict[str, Any]) -> str:
    """" (relaunched 2x, 2 crashes)" for a worker whose step was launched again (" (1 crash)" for one
    adopted from a controller that saved no record of it); "" for one launched once that never crashed."""
    try:
        again, crashes = int(worker.get("launches") or 1) - 1, int(worker.get("crash_count") or 0)
    except (TypeError, ValueError):
        return ""
    parts = ([f"relaunched {again}x"] if again > 0 else []) + (
        [f"{crashes} crash{'es' if crashes != 1 else ''}"] if crashes > 0 else [])
    return f" ({', '.join(parts)})" if parts else ""


def _weights_cell(worker: dict[str, Any]) -> str:
    """A server's weights version, the one it is being updated to, and failed updates in a row."""
    version = worker.get("weights_version")
    cell = "-" if version is None else str(version)
    if worker.get("weights_updating_to") is not None:
        cell += f" -> {worker['weights_updating_to']}"
    if worker.get("weights_update_failures"):
        cell += f" ({worker['weights_update_failures']} failed)"
    return cell


def slurm_says(doc: dict[str, Any]) -> str:
    """What Slurm keeps of a job the controller does not run for: an ended job's exit code, else
    Slurm's reason (a held job's ``JobHeldUser``), and where its output is ('' if Slurm says nothing)."""
    code, output = doc.get("job_exit_code"), printable(str(doc.get("job_output") or ""))
    reason = printable(str(doc.get("job_reason") or ""))
    how = f"exit {code}" if code is not None else f"reason: {reason}" if reason else ""
    if code == EXIT_CONFIG:
        how += ": the job's configuration was refused (by the controller, or the batch script could not read it)"
    if output and code:
        how += f"; its output says why: {output}"
    elif output:
        how += f"{'; ' if how else ''}its output: {output}"
    return f" ({how})" if how else ""


def render_status(job_id: int, status: dict[str, Any] | None, slurm_steps: list[dict[str, Any]] | None = None,
                  unreachable: str = "", now_s: float | None = None, refused: bool = False,
                  not_asked: bool = False, slurm_burst_jobs: list[dict[str, Any]] | None = None) -> str:
    """The status table. With ``status`` None (controller down; ``refused``: it answered with an
    error, a wrong token say; ``not_asked``: its token or controller file is missing or damaged
    here) it shows what Slurm reports: the job's steps, its burst jobs and theirs."""
    status, slurm_steps, unreachable = _printable_tree(status), _printable_tree(slurm_steps), printable(unreachable)
    slurm_burst_jobs = _printable_tree(slurm_burst_jobs)
    lines = [f"job {job_id}"]
    if status is None:
        word = "REFUSED the request" if refused else "NOT ASKED" if not_asked else "UNREACHABLE"
        lines.append(f"controller: {word} ({unreachable})" if unreachable else f"controller: {word}")
        lines.append("job steps Slurm reports (the controller's view is unavailable):")
        rows = [[str(s.get("step_id", "")), str(s.get("name", "")), ",".join(s.get("nodes", [])),
                 str(s.get("time_used", ""))] for s in slurm_steps or []]
        lines += ["  " + r for r in _table(["STEP", "NAME", "NODE", "TIME"], rows)] if rows else ["  (none)"]
        if slurm_burst_jobs:
            lines.append(f"burst jobs Slurm lists for it: {len(slurm_burst_jobs)}")
            rows = [[str(j.get("job_id", "")), str(j.get("state", "")), ",".join(j.get("nodes", [])) or "-",
                     str(j.get("reason", "")) or "-"] for j in slurm_burst_jobs]
            lines += ["  " + r for r in _table(["JOB", "STATE", "NODE", "REASON"], rows)]
        return "\n".join(lines) + "\n"
    ctl = status.get("controller", status)
    decision = ctl.get("last_decision") or {}
    left = ctl.get("time_limit_in_s")
    lines.append(f"controller: {ctl.get('controller_url', '?')}  up {_age(ctl.get('uptime_s'))}"
                 f"  ticks {ctl.get('ticks', '?')}" + ("" if left is None else f"  time limit in {_age(_not_below_zero(left))}"))
    disabled = str(decision.get("reason", "")).startswith("autoscaler disabled")
    mode = ("wake-all" if ctl.get("wake_all") else "paused" if ctl.get("paused")
            else "autoscaler disabled" if disabled else "autoscaling")
    usable = ctl.get("usable_slots")
    if isinstance(usable, int) and isinstance(ctl.get("target_workers"), int) and ctl["target_workers"] > usable:
        mode += f"; only {usable} GPU slot{'' if usable == 1 else 's'} usable now"
    action, reason = decision.get("action", "-"), str(decision.get("reason", "-"))
    said = reason if reason.startswith(f"{action}:") else f"{action}: {reason}"  # a hold's reason says "hold:"
    target = ctl.get("target_workers", "?")
    if action == "drain":  # the job's time limit is near: none, whatever the target to come back to
        target, mode = 0, f"draining before the job's time limit; then {target}"
    lines.append(f"target: {target} worker{'' if target == 1 else 's'} ({mode})  last decision: {said}")
    queue = ctl.get("queue") or status.get("queue") or {}
    if queue:
        lines.append(
            f"buffer: {queue.get('queued_sequences', '?')}/{queue.get('capacity_sequences', '?')} sequences"
            f"  staleness capacity {queue.get('staleness_capacity', '?')}"
            f"  trainer version {queue.get('policy_version', '?')}"
            f"  delivered {queue.get('delivered_sequences', '?')}"
            + (f"  LOST {queue['lost_groups']} groups (damaged records)" if queue.get("lost_groups") else "")
        )
        lines.append(_trainer_line(queue))
    weights = ctl.get("weights")
    if weights:
        workers = [w for w in ctl.get("workers", []) if w.get("state") == "ACTIVE" and w.get("endpoint")]
        at_latest = sum(1 for w in workers if w.get("weights_version") == weights.get("version"))
        lines.append(f"weights: version {weights.get('version')} ({weights.get('ref')})  servers at it: "
                     f"{at_latest}/{len(workers)}" + ("" if weights.get("enforced") else "  (no update hook)"))
    servers = ctl.get("servers")
    if isinstance(servers, dict):
        lines.append(_servers_line(servers))
    lines.append(f"workers: {worker_counts(ctl) or 'none'}")
    rows = []
    workers = ctl.get("workers", [])
    in_burst = any(w.get("job_id") not in (None, job_id) for w in workers)  # a JOB column only when it says something
    show_weights = bool(weights) or any(w.get("weights_version") is not None for w in workers)
    for w in workers:
        waiting = w.get("state") == "BACKOFF"  # no step: it holds no GPU, and nothing heart-beats
        nodes, gpus = ("-", "-") if waiting else _nodes_and_gpus(w)
        state = w.get("state", "?") + (" (placeholder)" if w.get("placeholder") else "") + _relaunched(w)
        rows.append([str(w.get("worker_id", "")), *([str(w.get("job_id") or "-")] if in_burst else []),
                     str(w.get("step_id") or "-"), nodes, gpus,
                     state, _age(w.get("age_s")), str(w.get("rollouts", 0)), _per_rollout(w),
                     "-" if waiting else _age(w.get("last_heartbeat_age_s"))]
                    + ([_weights_cell(w)] if show_weights else []))
    if rows:
        headers = ["WORKER", *(["JOB"] if in_burst else []), "STEP", "NODE", "GPU", "STATE", "AGE", "ROLLOUTS", "S/ROLLOUT",
                   "HEARTBEAT"]
        lines += ["  " + r for r in _table(headers + (["WEIGHTS"] if show_weights else []), rows)]
    ended = ctl.get("ended_workers") or []
    if ended:
        lines.append("ended last:")
        erows = [[str(e.get("worker_id", "")), _where(e), f"{_age(e.get('ended_s_ago'))} ago", str(e.get("reason", ""))]
                 for e in ended]
        lines += ["  " + r for r in _table(["WORKER", "WHERE", "ENDED", "WHY"], erows)]
    lines += _burst_lines(ctl)
    now = now_s if now_s is not None else float(ctl.get("now_s", 0.0))
    cordons = ctl.get("cordoned_gpus") or []
    if cordons:
        lines.append("cordoned GPUs:")
        crow = [[f"{node}:{_gpu_list(gpus)}", source, since, reason]
                for (node, source, since, reason), gpus in _cordons_by_cause(cordons, now).items()]
        lines += ["  " + r for r in _table(["GPU", "BY", "SINCE", "REASON"], crow)]
    for left in ctl.get("left_nodes") or []:
        lines.append(f"node {left.get('node')} left the job {_since(left.get('at_s'), now)} (failed, or the job "
                     f"shrunk): its {left.get('gpus')} GPUs get no more workers")
    unknown = ctl.get("unknown_health_nodes") or []
    if unknown:
        lines.append(f"health unknown (agent silent, no new workers): {', '.join(unknown)}")
    agent_errors = ctl.get("agent_errors") if isinstance(ctl.get("agent_errors"), dict) else {}
    for node, errors in agent_errors.items():
        if isinstance(errors, list) and errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            lines.append(f"agent on {node} reports: {errors[0]}{more}")
    notes = ctl.get("state_notes") or ([ctl["state_note"]] if ctl.get("state_note") else [])
    lines += [f"saved state: {note}" for note in notes]
    errors = [e for e in ctl.get("errors") or [] if not (notes and e.get("where") == "state")  # shown above
              and _recent(e.get("at_s"), now)]
    for err in errors[-3:]:
        when = "" if err.get("at_s") is None else f" {_since(err.get('at_s'), now)}"
        lines.append(f"recent error [{err.get('where')}]{when}: {err.get('error')}")
    return "\n".join(lines) + "\n"


def _servers_line(servers: dict[str, Any]) -> str:
    """"servers: 3 routable, 4 requests outstanding (load 0.33 of capacity 4 each); 2 routers: 108 sent,
    1 retried, 0 failed" (the routers' totals over the last 10 s)."""
    try:
        endpoints = list(servers.get("endpoints") or [])
        outstanding = sum(int(e.get("outstanding") or 0) for e in endpoints if isinstance(e, dict))
        ratio = servers.get("load_ratio")
        load = ("" if ratio is None
                else f" (load {float(ratio):.2f} of capacity {servers.get('requests_per_worker_capacity')} each)")
        routers = int(servers.get("routers") or 0)
    except (TypeError, ValueError):
        return "servers: ? (unreadable)"
    said = (f"; {routers} router{'' if routers == 1 else 's'}: {servers.get('requests_sent', 0)} sent, "
            f"{servers.get('requests_retried', 0)} retried, {servers.get('requests_failed', 0)} failed" if routers
            else "; no router reported in the last 10 s")
    return f"servers: {len(endpoints)} routable, {outstanding} requests outstanding{load}{said}"


def _burst_lines(ctl: dict[str, Any]) -> list[str]:
    """Burst jobs (docs/burst.md): GPU-seconds held and used, the counts, the last decision, then
    one row per job."""
    burst, jobs = ctl.get("burst") or {}, ctl.get("burst_jobs") or []
    if not burst and not jobs:
        return []
    lines = [f"burst jobs: {len(jobs)}  held {float(burst.get('gpu_s_held', 0)):.0f} GPU-s, used "
             f"{float(burst.get('gpu_s_used', 0)):.0f}  submitted {burst.get('submitted', 0)}  lost {burst.get('lost', 0)}"
             + "".join(f"  {key} {burst[key]}" for key in ("cancelled", "requeued") if burst.get(key))]
    if burst.get("last_decision"):
        lines.append(f"  decision: {burst['last_decision']}")
    rows = [[str(j.get("job_id", "")), str(j.get("state", "")), ",".join(j.get("nodes", [])) or "-",
             str(j.get("gpus", "")), str(j.get("workers", 0)), str(j.get("pending_reason") or "-")] for j in jobs]
    if rows:
        lines += ["  " + r for r in _table(["JOB", "STATE", "NODE", "GPUS", "WORKERS", "REASON"], rows)]
    return lines


def worker_counts(ctl: dict[str, Any]) -> str:
    """Workers per state, and the steps holding cordoned GPUs apart ("active 6  placeholders 1")."""
    counts = [(k.lower(), v) for k, v in (ctl.get("workers_by_state") or {}).items() if v]
    if ctl.get("placeholders"):
        counts.append(("placeholders", ctl["placeholders"]))
    return "  ".join(f"{k} {v}" for k, v in counts)


TRAINER_QUIET_S = 30.0  # a trainer not heard from this long: status says when it last was


def _trainer_line(queue: dict[str, Any]) -> str:
    """The trainer as the queue measures it: its step, its demand, its consumption and its waits."""
    step_s, wait = queue.get("trainer_step_s"), queue.get("trainer_wait_fraction")
    consumed = queue.get("consumption_seqs_per_s")
    batch = queue.get("batch_size")
    if not isinstance(step_s, int | float) or step_s <= 0:
        return "trainer: no step measured yet"
    demand = f" (demand {batch / step_s:.2f} seqs/s)" if isinstance(batch, int) and batch > 0 else ""
    line = f"trainer: step {step_s:.1f} s{demand}"
    if isinstance(consumed, int | float):
        line += f"  consumes {consumed:.2f} seqs/s"
    if isinstance(wait, int | float):
        line += f"  waited for rollouts {wait:.0%} of its last steps"
    heard_s_ago = queue.get("trainer_last_call_s_ago")
    if isinstance(heard_s_ago, int | float) and heard_s_ago >= TRAINER_QUIET_S:
        line += f"  (its last call to the controller: {_age(heard_s_ago)} ago)"
    return line
