"""Runs as the batch script of a parent job: submits one burst job as the controller does, waits
until it runs, launches a probe step into it (srun --jobid=<burst job>), then holds the allocation.

usage: python -m tests.cluster.burst_parent TMP PARTITION
Writes TMP/parent.json: {"burst": <job id>}; the probe writes TMP/probe.jsonl.
"""

import json
import sys
import time
from pathlib import Path

from slurm_elastic.controller.burst_jobs import BurstJobs
from slurm_elastic.controller.config import parse_config
from slurm_elastic.slurm.backend import StepSpec
from slurm_elastic.slurm.cli_backend import SlurmCli

tmp, partition = Path(sys.argv[1]), sys.argv[2]
parent = int(__import__("os").environ["SLURM_JOB_ID"])
config = parse_config({"burst": {"max_jobs": 1, "gpus_per_job": 2, "partition": partition,
                                 "controller_unreachable_grace_s": 600}})
slurm = SlurmCli()
jobs = BurstJobs(slurm, config, parent, tmp / "state")
burst = jobs.submit()
deadline = time.monotonic() + 60
while not any(j.job_id == burst and j.state == "RUNNING" for j in jobs.listed()):
    if time.monotonic() > deadline:
        sys.exit(f"burst job {burst} did not start")
    time.sleep(0.3)
probe = Path(__file__).with_name("signal_probe.py")
slurm.launch_step(StepSpec(job_id=burst, name="se-w-burst", argv=(sys.executable, str(probe), str(tmp / "probe.jsonl")),
                           output_path=tmp / "probe.out"), tmp / "launcher.log")
(tmp / "parent.json").write_text(json.dumps({"burst": burst}))
time.sleep(3600)
