"""The simulator's adapter: read a trace file, write summary.json, draw timeline.png (matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path

from slurm_elastic.errors import ConfigError, SlurmElasticError
from slurm_elastic.sim.results import SimResult
from slurm_elastic.sim.trace import Trace, parse_trace


def load_trace(path: Path) -> Trace:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the trace: {exc.strerror}") from exc
    return parse_trace(text, name=str(path))


def summary_text(result: SimResult) -> str:
    """A few lines for the terminal."""
    m = result.metrics
    return "\n".join([
        f"trace {result.trace}, policy {result.policy}, seed {result.seed}, {result.duration_s:g} s simulated",
        f"  trainer idle fraction {m['trainer_idle_fraction']:.3f}   trainer steps {m['trainer_steps']:.0f}",
        f"  GPU-seconds {m['gpu_seconds']:.0f} (mean {m['mean_workers']:.2f} workers)",
        f"  max staleness {m['max_staleness']:.0f} versions   dropped stale {m['dropped_stale_seqs']:.0f} seqs",
        f"  scale actions {m['scale_actions']:.0f}   reversals {m['reversals']:.0f}   "
        f"failures {m['worker_failures']:.0f}   launches {m['launches']:.0f}",
    ])


def write_summary(result: SimResult, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "summary.json"
    path.write_text(json.dumps(result.summary(), indent=2) + "\n")
    return path


def write_timeline(result: SimResult, path: Path) -> Path:
    """Buffer vs setpoint and capacity, staleness capacity, workers by state, decision markers."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SlurmElasticError("the timeline needs matplotlib: pip install 'slurm-elastic[plot]' "
                                "(or pass --no-plot)") from exc
    t = [s.t_s for s in result.samples]
    fig, (ax_buf, ax_workers) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, height_ratios=[3, 2])
    ax_buf.plot(t, [s.queued_seqs for s in result.samples], lw=0.8, color="tab:blue", label="buffer (queued seqs)")
    ax_buf.plot(t, [s.setpoint_seqs for s in result.samples], ls="--", color="tab:green", label="setpoint")
    ax_buf.plot(t, [s.staleness_capacity_seqs for s in result.samples], lw=0.6, color="tab:orange", alpha=0.7,
                label="staleness capacity")
    # the buffer's bound: a line when it is near the data, else named in the label (no squeezed curves)
    seen = max([s.queued_seqs for s in result.samples] + [s.staleness_capacity_seqs for s in result.samples] + [1])
    bound = max(s.buffer_capacity_seqs for s in result.samples) if result.samples else 0
    if bound <= 1.5 * seen:
        ax_buf.plot(t, [s.buffer_capacity_seqs for s in result.samples], ls=":", color="tab:red", label="buffer capacity")
    else:
        ax_buf.plot([], [], ls=":", color="tab:red", label=f"buffer capacity {bound:.0f} (off the chart)")
    ax_buf.set_ylabel("sequences")
    ax_buf.legend(loc="upper right", fontsize=8, ncols=4)
    m = result.metrics
    ax_buf.set_title(f"{result.trace} / {result.policy} (seed {result.seed}): idle "
                     f"{m['trainer_idle_fraction']:.3f}, {m['gpu_seconds']:.0f} GPU-s, max staleness "
                     f"{m['max_staleness']:.0f}, {m['scale_actions']:.0f} actions, {m['reversals']:.0f} reversals",
                     fontsize=10)
    active = [s.active for s in result.samples]
    starting = [s.starting for s in result.samples]
    draining = [s.draining for s in result.samples]
    ax_workers.stackplot(t, active, starting, draining, labels=["active", "starting", "draining"],
                         colors=["tab:blue", "tab:olive", "tab:gray"], alpha=0.6, step="post")
    ax_workers.step(t, [s.target for s in result.samples], where="post", color="black", lw=1.0, label="target")
    for event in result.scale_events:
        up = event.action == "scale_up"
        ax_workers.plot(event.t_s, event.target, marker="^" if up else "v", ls="none",
                        color="tab:green" if up else "tab:red", ms=7)
    ax_workers.set_ylabel("workers")
    ax_workers.set_xlabel("simulated time (s)")
    ax_workers.legend(loc="upper left", fontsize=8, ncols=4)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
