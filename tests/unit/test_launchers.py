"""This host's srun processes, read from the process table: what a restarted controller checks
its predecessor's saved launches against."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from slurm_elastic.slurm.launchers import running_step_launches


def test_an_srun_process_is_found_by_its_job_and_step_name(tmp_path: Path) -> None:
    srun = tmp_path / "srun"  # a stand-in named srun, as the process table names it
    srun.write_text("#!/bin/bash\nsleep 30\ntrue\n")
    srun.chmod(0o755)
    proc = subprocess.Popen([str(srun), "--jobid=4242", "--exact", "--job-name=se-w-0007", "python", "w.py"],
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while (4242, "se-w-0007") not in (running_step_launches() or set()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (4242, "se-w-0007") in (running_step_launches() or set())
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (4242, "se-w-0007") not in (running_step_launches() or set())
