"""The store's syncer outliving its controller (kill -9): its answer finds no reader, and it
ends quietly, where it used to print a BrokenPipeError traceback into the job's output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import slurm_elastic
from slurm_elastic.rollouts.syncer import COMMAND


def test_a_syncer_whose_controller_is_gone_ends_quietly(tmp_path: Path) -> None:
    (tmp_path / "segments").mkdir()
    read_end, write_end = os.pipe()
    os.close(read_end)  # the controller that would read the answer is gone
    done = subprocess.run(
        [sys.executable, "-I", "-c", COMMAND, str(Path(slurm_elastic.__file__).parent.parent), str(tmp_path / "q.sqlite"), str(tmp_path / "segments"), "always", "0",
         "buffered"], input=b"{}\n", stdout=write_end, stderr=subprocess.PIPE, timeout=60, check=False)
    os.close(write_end)
    assert done.returncode == 0 and done.stderr == b""
