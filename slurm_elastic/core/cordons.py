"""The cordon book: which GPUs get no new worker, why, and since when (pure; time comes in as ``now_s``).

Samples are judged by :func:`slurm_elastic.core.health.evaluate`; the book adds hysteresis,
operator, crash, prolog, pre-flight and Slurm (a node drained or down) cordons, and remembers when
each node's agent was last heard.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from slurm_elastic.core.health import AgentReport, GpuKey, GpuSample, HealthRules, evaluate

CordonSource = Literal["health", "prolog", "crash", "operator", "preflight", "slurm"]

_SOURCE_PRECEDENCE: tuple[CordonSource, ...] = ("operator", "slurm", "health", "prolog", "crash", "preflight")
_WATCHED: tuple[CordonSource, ...] = ("health", "prolog")  # lifted by the healthy period of the agent's samples


@dataclass(frozen=True)
class CordonEntry:
    """One cordon on one GPU."""

    reason: str
    since_s: float
    source: CordonSource

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "since_s": self.since_s, "source": self.source}


@dataclass(frozen=True)
class CordonChange:
    """A cordon placed or lifted by a call on the book (for logs and events)."""

    node: str
    gpu: int
    action: Literal["cordon", "uncordon"]
    source: CordonSource
    reason: str
    drain: bool = False
    """For a new health or Slurm cordon: the rules ask to drain a worker running on this GPU."""


@dataclass
class _Gpu:
    sample: GpuSample | None = None
    sample_at_s: float | None = None
    healthy_since_s: float | None = None
    crashes_s: list[float] = field(default_factory=list)
    preflight_required_mb: int = 0
    entries: dict[str, CordonEntry] = field(default_factory=dict)


class CordonBook:
    """Cordon state per GPU: which GPUs get no new worker, why, and since when.

    Sources: ``health`` (from samples, lifted after ``healthy_period_s`` of continuous
    healthy samples), ``prolog`` (the node's prolog sampled the GPU before the job and the job's
    rules judge that sample unhealthy; lifted like a health cordon), ``crash`` (repeated worker
    crashes; lifted by an operator or after ``crash_cordon_s``), ``operator`` (by hand; only an
    operator lifts it), ``preflight`` (not enough free memory at launch; lifted when a later
    sample shows enough) and ``slurm`` (Slurm marks the node drained, down, failing or rebooting;
    lifted when it no longer does).
    Times passed in are the controller's clock, not the agents'.
    """

    STATE_VERSION = 1

    def __init__(self, rules: HealthRules | None = None) -> None:
        self.rules = rules or HealthRules()
        self._gpus: dict[GpuKey, _Gpu] = {}
        self._heard_s: dict[str, float] = {}

    # ---- inputs

    def observe(self, samples: Iterable[GpuSample], now_s: float) -> list[CordonChange]:
        """Take in samples (one or more agent reports' worth) and update health cordons.

        A node appearing here counts as heard. A GPU seen before on such a node but missing
        from its samples now is treated as lost (fallen off the bus).
        """
        by_node: dict[str, list[GpuSample]] = {}
        for s in samples:
            by_node.setdefault(s.node, []).append(s)
        changes = self._expire(now_s)
        for node, node_samples in sorted(by_node.items()):
            self._heard_s[node] = now_s
            present = {s.index for s in node_samples}
            for (n, idx), g in sorted(self._gpus.items()):
                if n == node and idx not in present and g.sample is not None:
                    missing = replace(
                        g.sample, lost=True, errors=["missing from the agent's report"]
                    )
                    node_samples.append(missing)
            for s in node_samples:
                changes.extend(self._observe_one(s, now_s))
        return changes

    def move_clocks_on(self, paused_s: float, now_s: float) -> None:
        """The controller did not run for ``paused_s``: the agents were last heard that much later."""
        self._heard_s = {node: min(now_s, heard_s + paused_s) for node, heard_s in self._heard_s.items()}

    def forget_node(self, node: str) -> None:
        """Drop everything kept for ``node`` (it left the job): its GPUs' cordons and samples, and
        when its agent was last heard."""
        self._heard_s.pop(node, None)
        for key in [k for k in self._gpus if k[0] == node]:
            del self._gpus[key]

    def keep_only(self, node: str, gpus: Iterable[int]) -> None:
        """Drop what is kept for ``node``'s GPUs outside ``gpus`` (the job does not hold them)."""
        held = set(gpus)
        for key in [k for k in self._gpus if k[0] == node and k[1] not in held]:
            del self._gpus[key]

    def observe_report(self, report: AgentReport, now_s: float) -> list[CordonChange]:
        """Observe one agent report. A report with no GPUs at all (say NVML failed to start)
        does not count as hearing the node: its health stays unknown."""
        if not report.gpus:
            return self._expire(now_s)
        return self.observe(report.gpus, now_s)

    def record_prolog(self, samples: Iterable[GpuSample], now_s: float) -> list[CordonChange]:
        """Judge the prologs' samples (taken before the job) with these rules; cordon what fails.
        They do not count as hearing a node: only its agent does."""
        changes = []
        for s in samples:
            reasons = evaluate(s, self.rules)
            g = self._gpu(s.node, s.index)
            if reasons and "prolog" not in g.entries:
                reason = "before the job: " + ", ".join(reasons)
                g.entries["prolog"] = CordonEntry(reason, now_s, "prolog")
                changes.append(CordonChange(s.node, s.index, "cordon", "prolog", reason))
        return changes

    def observe_slurm_nodes(self, out_of_use: Mapping[str, str], gpus_by_node: Mapping[str, Iterable[int]],
                            now_s: float) -> list[CordonChange]:
        """Slurm's word on the job's nodes (``gpus_by_node``): every GPU of a node in
        ``out_of_use`` (node -> why) is cordoned by ``slurm``; the cordon lifts once Slurm no
        longer names the node. A changed reason replaces the old one."""
        changes = []
        drain = self.rules.on_node_out == "drain"
        for node, gpus in sorted(gpus_by_node.items()):
            why = out_of_use.get(node)
            for gpu in sorted(gpus):
                g = self._gpu(node, gpu)
                old = g.entries.get("slurm")
                if why is not None and old is None:
                    g.entries["slurm"] = CordonEntry(why, now_s, "slurm")
                    changes.append(CordonChange(node, gpu, "cordon", "slurm", why, drain))
                elif why is not None and old is not None and old.reason != why:
                    g.entries["slurm"] = replace(old, reason=why)
                elif why is None and old is not None:
                    del g.entries["slurm"]
                    changes.append(CordonChange(node, gpu, "uncordon", "slurm", f"Slurm no longer marks node {node}"))
        return changes

    def record_crash(self, node: str, gpu: int, now_s: float, last: str = "") -> list[CordonChange]:
        """Count a worker crash on this GPU; cordon it at ``crash_threshold`` in the window (the
        reason names ``last``, the crash that did it, where given)."""
        g = self._gpu(node, gpu)
        window = self.rules.crash_window_s
        g.crashes_s = [t for t in g.crashes_s if now_s - t < window] + [now_s]
        changes = self._expire(now_s)
        if len(g.crashes_s) >= self.rules.crash_threshold and "crash" not in g.entries:
            reason = f"{len(g.crashes_s)} worker crashes within {window:g}s" + (f" (the last: {last})" if last else "")
            g.entries["crash"] = CordonEntry(reason, now_s, "crash")
            changes.append(CordonChange(node, gpu, "cordon", "crash", reason))
        return changes

    def record_preflight_failure(
        self, node: str, gpu: int, required_free_mb: int, reason: str, now_s: float
    ) -> CordonChange | None:
        """Cordon a GPU that failed the launch-time check, until a sample shows enough memory."""
        g = self._gpu(node, gpu)
        g.preflight_required_mb = max(required_free_mb, 0)
        if "preflight" in g.entries:
            return None
        g.entries["preflight"] = CordonEntry(reason, now_s, "preflight")
        return CordonChange(node, gpu, "cordon", "preflight", reason)

    def cordon_manual(self, node: str, gpu: int, reason: str, now_s: float) -> CordonChange:
        """An operator cordon: sticky until :meth:`uncordon_manual`."""
        g = self._gpu(node, gpu)
        entry = CordonEntry(reason or "cordoned by operator", now_s, "operator")
        g.entries["operator"] = entry
        return CordonChange(node, gpu, "cordon", "operator", entry.reason)

    def uncordon_manual(self, node: str, gpu: int, now_s: float) -> list[CordonChange]:
        """Lift operator, prolog, crash and pre-flight cordons (and forget counted crashes).

        A health cordon stays: it lifts by itself after the healthy period. So does a Slurm
        cordon: it lifts when Slurm no longer marks the node.
        """
        g = self._gpus.get((node, gpu))
        if g is None:
            return []
        changes = []
        for source in ("operator", "prolog", "crash", "preflight"):
            entry = g.entries.pop(source, None)
            if entry is not None:
                changes.append(CordonChange(node, gpu, "uncordon", entry.source, "by operator"))
        g.crashes_s = []
        return changes

    def tick(self, now_s: float) -> list[CordonChange]:
        """Lift time-limited cordons (crash cordons past ``crash_cordon_s``)."""
        return self._expire(now_s)

    # ---- queries

    def cordoned(self) -> dict[GpuKey, CordonEntry]:
        """The cordoned GPUs, each with its main entry (operator > health > crash > preflight)."""
        out: dict[GpuKey, CordonEntry] = {}
        for key, g in sorted(self._gpus.items()):
            for source in _SOURCE_PRECEDENCE:
                if source in g.entries:
                    out[key] = g.entries[source]
                    break
        return out

    def others(self, key: GpuKey) -> list[CordonEntry]:
        """A GPU's cordons besides its main one (:meth:`cordoned`), in the same precedence."""
        g = self._gpus.get(key)
        entries = [g.entries[s] for s in _SOURCE_PRECEDENCE if g is not None and s in g.entries]
        return entries[1:]

    def entry(self, key: GpuKey, source: CordonSource) -> CordonEntry | None:
        """The cordon of ``source`` on a GPU, if it has one."""
        g = self._gpus.get(key)
        return None if g is None else g.entries.get(source)

    def cordoned_by(self, source: CordonSource) -> set[GpuKey]:
        """The GPUs that carry a cordon of ``source`` (whichever cordon status shows for them)."""
        return {key for key, g in self._gpus.items() if source in g.entries}

    def drain_targets(self) -> set[GpuKey]:
        """GPUs whose running worker should be drained now: health cordons if the rules say
        ``on_unhealthy = "drain"``, Slurm cordons if ``on_node_out = "drain"``. Level-triggered:
        ask every tick."""
        sources = {source for source, rule in (("health", self.rules.on_unhealthy), ("slurm", self.rules.on_node_out))
                   if rule == "drain"}
        return {key for key, g in self._gpus.items() if sources & g.entries.keys()}

    def heard_s(self, node: str) -> float | None:
        """When ``node``'s agent was last heard; None if never (or since the node was forgotten)."""
        return self._heard_s.get(node)

    def unknown_nodes(
        self, now_s: float, silence_s: float | None = None, nodes: Iterable[str] = ()
    ) -> set[str]:
        """Nodes whose agent was not heard within ``silence_s`` (default from the rules),
        plus any of ``nodes`` (the allocation's nodes) never heard at all."""
        limit = self.rules.agent_silence_s if silence_s is None else silence_s
        out = {n for n, t in self._heard_s.items() if now_s - t > limit}
        out.update(n for n in nodes if n not in self._heard_s)
        return out

    def latest_sample(self, node: str, gpu: int) -> GpuSample | None:
        g = self._gpus.get((node, gpu))
        return None if g is None else g.sample

    def preflight_ok(self, node: str, gpu: int, required_free_mb: int) -> tuple[bool, str]:
        """Launch-time check: the latest sample of **this** GPU has enough free memory."""
        s = self.latest_sample(node, gpu)
        where = f"{node}:{gpu}"
        if s is None:
            return False, f"no telemetry for {where}"
        if s.lost:
            return False, f"{where} is lost"
        free = s.memory_free_mb
        if free is None:
            return False, f"free memory of {where} unknown"
        if free < required_free_mb:
            return False, f"{where} has {free} MiB free, worker needs {required_free_mb} MiB"
        return True, ""

    # ---- persistence

    def to_state(self) -> dict[str, Any]:
        """JSON-serialisable state (no samples: they are stale after a restart)."""
        gpus = []
        for (node, idx), g in sorted(self._gpus.items()):
            if not g.entries and not g.crashes_s and g.healthy_since_s is None:
                continue
            gpus.append(
                {
                    "node": node,
                    "gpu": idx,
                    "healthy_since_s": g.healthy_since_s,
                    "crashes_s": list(g.crashes_s),
                    "preflight_required_mb": g.preflight_required_mb,
                    "entries": [g.entries[s].to_dict() for s in sorted(g.entries)],
                }
            )
        return {"version": self.STATE_VERSION, "heard_s": dict(self._heard_s), "gpus": gpus}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], rules: HealthRules | None = None) -> CordonBook:
        """Rebuild from :meth:`to_state`; raises ``ValueError`` on a foreign or bad state."""
        if not isinstance(state, Mapping) or state.get("version") != cls.STATE_VERSION:
            raise ValueError(f"cordon state: expected version {cls.STATE_VERSION}")
        book = cls(rules)
        try:
            for node, t in dict(state.get("heard_s", {})).items():
                book._heard_s[str(node)] = float(t)
            for item in state.get("gpus", []):
                g = book._gpu(str(item["node"]), int(item["gpu"]))
                hs = item.get("healthy_since_s")
                g.healthy_since_s = None if hs is None else float(hs)
                g.crashes_s = [float(t) for t in item.get("crashes_s", [])]
                g.preflight_required_mb = int(item.get("preflight_required_mb", 0))
                for e in item.get("entries", []):
                    source = e["source"]
                    if source not in _SOURCE_PRECEDENCE:
                        raise ValueError(f"cordon state: unknown source {source!r}")
                    g.entries[source] = CordonEntry(str(e["reason"]), float(e["since_s"]), source)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"cordon state: malformed ({exc!r})") from None
        return book

    # ---- internals

    def _gpu(self, node: str, gpu: int) -> _Gpu:
        return self._gpus.setdefault((node, gpu), _Gpu())

    def _observe_one(self, s: GpuSample, now_s: float) -> list[CordonChange]:
        g = self._gpu(s.node, s.index)
        gap_s = None if g.sample_at_s is None else now_s - g.sample_at_s
        g.sample, g.sample_at_s = s, now_s
        changes: list[CordonChange] = []
        pre = g.entries.get("preflight")
        free = s.memory_free_mb
        if pre is not None and not s.lost and free is not None and free >= g.preflight_required_mb:
            del g.entries["preflight"]
            changes.append(CordonChange(s.node, s.index, "uncordon", "preflight", "memory free"))
        reasons = evaluate(s, self.rules)
        if reasons:
            g.healthy_since_s = None
            reason = ", ".join(reasons)
            old = g.entries.get("health")
            if old is None:
                g.entries["health"] = CordonEntry(reason, now_s, "health")
                drain = self.rules.on_unhealthy == "drain"
                changes.append(CordonChange(s.node, s.index, "cordon", "health", reason, drain))
            elif old.reason != reason:
                g.entries["health"] = replace(old, reason=reason)
            return changes
        watched = [source for source in _WATCHED if source in g.entries]
        if not watched:
            g.healthy_since_s = None
            return changes
        if g.healthy_since_s is None or (gap_s is not None and gap_s > self.rules.agent_silence_s):
            g.healthy_since_s = now_s
        if now_s - g.healthy_since_s >= self.rules.healthy_period_s:
            g.healthy_since_s = None
            period = f"healthy for {self.rules.healthy_period_s:g}s"
            for source in watched:
                del g.entries[source]
                changes.append(CordonChange(s.node, s.index, "uncordon", source, period))
        return changes

    def _expire(self, now_s: float) -> list[CordonChange]:
        limit = self.rules.crash_cordon_s
        changes: list[CordonChange] = []
        if limit <= 0:
            return changes
        for (node, idx), g in sorted(self._gpus.items()):
            entry = g.entries.get("crash")
            if entry is not None and now_s - entry.since_s >= limit:
                del g.entries["crash"]
                g.crashes_s = []
                changes.append(CordonChange(node, idx, "uncordon", "crash", "crash cordon expired"))
        return changes
