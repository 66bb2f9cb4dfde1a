"""What `./run example` prints of the sequences refused as stale: every worker's, from their
logs. Before, it printed the controller's count, which starts again at the restart the example
causes: on the dev cluster it read "64 refused stale at submit" where the workers' logs said 16
groups of 8 (128 sequences)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "run_example.py"


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_example", EXAMPLE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_stale_refusals_are_summed_over_every_workers_last_line(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "worker-0001.out").write_text("worker 0001: drained after 64 groups: 62 stored, 2 stale\n")
    (logs / "worker-0002.out").write_text(  # killed once (no line), relaunched under the same id, drained
        "slurmstepd-node1: error: *** STEP 7.4 ON node1 CANCELLED ***\n"
        "WARNING slurm_elastic.worker.wrapper: heartbeat failed (controller down?)\n"
        "worker 0002: drained after 9 groups: 6 stored, 1 policy_version_ahead, 2 stale\n")
    (logs / "worker-0003.out").write_text("worker 0003: drained after 4 groups: 4 stored, none refused\n")
    (logs / "agent-node1.out").write_text("worker 0009: drained after 9 groups: 0 stored, 9 stale\n")  # not a worker's
    module = example()
    assert module.refused_stale_by_worker_logs(tmp_path) == 4
    assert module.GROUP_SIZE == 8  # examples/elastic.toml's GROUP_SIZE
