"""Bad input, tried for real: writes bench/out/bad-input.md (the table in docs/bad-input.md).

    ./run setup && .venv/bin/slurm-elastic devcluster up
    eval "$(.venv/bin/slurm-elastic devcluster env)" && PATH=$PWD/.venv/bin:$PATH .venv/bin/python bench/bench_bad_input.py

Runs every probe of tests/cluster/bad_input.py: a live controller job on the dev cluster (HTTP
API, CLI, state file), then a one-node scratch cluster: bad configurations of a controller for a
job there, and its slurmctld hung and killed under that running controller. About 3 minutes; exit status 1 if any probe does not hold.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write_headline, write_report
from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec, default_dir
from slurm_elastic.errors import DevClusterError
from tests.cluster.bad_input import markdown, run_all


def main() -> int:
    try:
        cluster = DevCluster.at(default_dir())
    except DevClusterError:
        cluster = DevCluster(DevClusterSpec(dir=default_dir()))
    cluster.up(wait_s=90)
    os.environ["SLURM_CONF"] = str(cluster.conf_path)
    with tempfile.TemporaryDirectory(prefix="se-bad-input-") as tmp_name:
        tmp = Path(tmp_name)
        probes = run_all(cluster, tmp)
        table = markdown(probes, tmp)
    held = sum(p.ok for p in probes)
    write_report("bad-input", f"## Bad input: {held} of {len(probes)} probes hold\n\n{table}")
    write_headline("bad-input", [("bad inputs tried (API, CLI, config, state file, Slurm down)",
                                  f"{held} of {len(probes)} get a clear error and lose nothing", "", "")])
    return 0 if held == len(probes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
