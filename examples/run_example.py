"""What `./run example` runs: the elastic RL example on the local dev cluster.

Until the full example lands this is a smoke job: it submits a batch job that launches one
worker step per fake GPU through slurm-elastic's Slurm adapter and prints where each step ran
and which fake GPU it could open (exactly its own).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    out = subprocess.run(["sbatch", "--parsable", "--wait", str(HERE / "smoke.sbatch")],
                         capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        return out.returncode
    job_id = out.stdout.strip().split(";")[0]
    log = Path(f"/tmp/slurm-elastic-smoke-{job_id}.out")
    for _ in range(50):
        if log.exists():
            break
        time.sleep(0.1)
    print(log.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
