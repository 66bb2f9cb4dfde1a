"""At start, take in what the node prologs found (docs/admin.md): their GPU samples, judged with
the job's ``[health]`` rules, cordon (by ``prolog``) every GPU that fails before a worker goes there.

Each node's prolog writes ``<node_state_dir>/<job id>/gpu-health-<node>.json``; the controller reads
the files it can see (every node's where ``node_state_dir`` is shared, else its own node's), once
per job: a marker in the state directory keeps a restarted controller from cordoning again what the
agents have since found healthy.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from slurm_elastic.client.wire import AgentReportBody
from slurm_elastic.controller.runtime import Controller
from slurm_elastic.core.health import GpuSample
from slurm_elastic.hooks.common import HookConfig, load_hook_config
from slurm_elastic.hooks.prolog import result_file_name

log = logging.getLogger(__name__)

MARKER_FILE = "prolog-results.json"


def read_prolog_samples(node_state_dir: Path, job_id: int, nodes: Iterable[str]) -> tuple[list[GpuSample], list[str]]:
    """The samples of each node's prolog result that this host can read, and what could not be read."""
    samples: list[GpuSample] = []
    problems: list[str] = []
    directory = node_state_dir / str(job_id)
    for node in sorted(nodes):
        path = directory / result_file_name(node)
        try:
            report = AgentReportBody.model_validate(json.loads(path.read_text())["report"]).to_core()
        except FileNotFoundError:
            problems.append(f"{node}: no prolog result ({path})")
            continue
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append(f"{node}: unreadable prolog result {path}: {exc}")
            continue
        if report.node != node:
            problems.append(f"{node}: {path} describes node {report.node!r}")
            continue
        samples.extend(report.gpus)
    return samples, problems


def take_prolog_results(controller: Controller, state_dir: Path, hooks: HookConfig | None = None) -> None:
    """Once per job: cordon the GPUs whose prolog samples fail the job's rules; record what was read."""
    marker = state_dir / MARKER_FILE
    if marker.exists():
        return
    try:
        config = hooks or load_hook_config()
    except (OSError, ValueError, TypeError) as exc:  # the admins' file: a bad one must not stop the job
        log.warning("prolog results not read: the hooks config is unreadable: %s", exc)
        return
    samples, problems = read_prolog_samples(config.node_state_dir, controller.job_id, controller.gpus_by_node)
    with controller.lock:
        changes = controller.state.cordons.record_prolog(samples, controller.clock())
    for change in changes:
        log.warning("cordoned %s:%d (prolog): %s", change.node, change.gpu, change.reason)
    if problems:
        log.info("prolog results not taken in: %s", "; ".join(problems))
    controller.save()
    marker.write_text(json.dumps({
        "nodes_read": sorted({s.node for s in samples}), "problems": problems,
        "cordoned": [f"{c.node}:{c.gpu}" for c in changes],
    }, indent=1))
