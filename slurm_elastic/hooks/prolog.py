"""``slurm-elastic-prolog``: before a job, check the node's GPUs and record their health.

Writes ``<node_state_dir>/<job id>/gpu-health-<node>.json`` (readable by the job's user): the raw
samples, which the job's controller judges with the job's ``[health]`` rules at start (it cannot
know them here: the prolog runs as root before the job), and a verdict by the default rules for a
person reading the file. In strict mode
a *definitively* bad GPU (lost, uncorrectable ECC errors, failed row remapping) fails the prolog
so that Slurm drains the node. Anything else, including a bug here or NVML missing, is logged
and the prolog succeeds: a prolog that fails by accident drains a healthy node.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence

from slurm_elastic.client.wire import report_json
from slurm_elastic.core.health import GpuSample, HealthRules, evaluate
from slurm_elastic.hooks.common import (
    STRICT_BAD_GPU_EXIT,
    HookConfig,
    job_dir,
    load_hook_config,
    setup_logging,
)


def definitively_bad(sample: GpuSample) -> str:
    """Why a GPU is beyond doubt unusable ('' if it is not): never for what could not be read."""
    if sample.lost:
        return "GPU lost"
    if (sample.ecc_uncorrectable_volatile or 0) > 0:
        return f"{sample.ecc_uncorrectable_volatile} uncorrectable ECC errors"
    if sample.remapped_rows_failure:
        return "row remapping failed"
    return ""


def result_file_name(node: str) -> str:
    """The prolog's result for one node (one file per node: a shared node_state_dir holds them all)."""
    return f"gpu-health-{node}.json"


def run(config: HookConfig, problems: Sequence[str] = ()) -> int:
    from slurm_elastic.gpu.agent import build_report, make_source

    log = setup_logging(config, "prolog")
    for problem in problems:
        log.error("%s", problem)
    job_id = os.environ.get("SLURM_JOB_ID", "")
    node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    if not job_id:
        log.error("no SLURM_JOB_ID: not run by slurmd; nothing to do")
        return 0
    source = make_source(config.source, node, config.inject_file or None, config.gpus or None)  # type: ignore[arg-type]
    try:
        report = build_report(source, node, time.time())
    finally:
        source.close()
    rules = HealthRules()
    verdicts = {str(s.index): evaluate(s, rules) for s in report.gpus}
    bad = {str(s.index): why for s in report.gpus if (why := definitively_bad(s))}
    directory = job_dir(config, job_id)
    directory.mkdir(parents=True, exist_ok=True, mode=0o755)
    path = directory / result_file_name(node)
    path.write_text(json.dumps({"job_id": job_id, "node": node, "checked_at_s": time.time(),
                                "report": report_json(report), "unhealthy_by_default_rules": verdicts, "definitively_bad": bad},
                               indent=1))
    uid = int(os.environ.get("SLURM_JOB_UID", "-1"))
    if uid >= 0:
        for target in (directory, path):
            try:
                os.chown(target, uid, -1)
            except OSError as exc:
                log.warning("could not give %s to uid %d: %s", target, uid, exc)
    log.info("checked %d GPUs (%s): unhealthy %s; wrote %s", len(report.gpus), report.source,
             {k: v for k, v in verdicts.items() if v} or "none", path)
    if bad and config.strict:
        for index, why in bad.items():
            print(f"slurm-elastic prolog: GPU {index} on {node}: {why}")
            log.error("strict mode: GPU %s: %s: failing the prolog so Slurm drains %s", index, why, node)
        return STRICT_BAD_GPU_EXIT
    return 0


def main() -> int:
    try:
        problems: list[str] = []
        return run(load_hook_config(problems=problems), problems)
    except Exception:  # a hook's own error must never drain the node
        import logging

        logging.getLogger("prolog").exception("prolog failed; exiting 0 so the node stays in service")
        return 0


if __name__ == "__main__":
    sys.exit(main())
