"""The default backend: Slurm's own command-line tools, with machine-readable output."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from slurm_elastic.errors import SlurmCommandError, SlurmError
from slurm_elastic.slurm.backend import StepSpec, build_srun_argv, step_signal_name
from slurm_elastic.slurm.parse import (
    STEP_FORMAT,
    JobInfo,
    StepInfo,
    parse_jobs_json,
    parse_sdiag_rpc_counts,
    parse_step_lines,
)
from slurm_elastic.slurm.runner import run_command, spawn_detached

log = logging.getLogger(__name__)



class SlurmCli:
    """Slurm through ``squeue``/``srun``/``scancel``/``sdiag``.

    Steps are listed with one ``squeue --steps --format`` call: on Slurm 22.05 ``squeue --json``
    ignores ``--steps`` and prints jobs only, so the JSON path cannot list steps there.
    """

    name = "cli"

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s  # None: the runner's command timeout (controller.slurm_timeout_s)

    def list_steps(self, job_id: int) -> list[StepInfo]:
        result = run_command(
            ["squeue", "--steps", f"--jobs={int(job_id)}", "--noheader", f"--format={STEP_FORMAT}"],
            timeout_s=self.timeout_s,
        )
        return [s for s in parse_step_lines(result.stdout) if s.job_id == job_id]

    def job_info(self, job_id: int) -> JobInfo:
        try:
            result = run_command(["squeue", "--json", f"--jobs={int(job_id)}"], timeout_s=self.timeout_s)
        except SlurmCommandError as exc:
            if "Invalid job id" in exc.stderr:
                raise SlurmError(f"job {job_id} is unknown to Slurm (finished long ago, or never existed)") from None
            raise
        jobs = [j for j in parse_jobs_json(result.stdout) if j.job_id == job_id]
        if not jobs:
            raise SlurmError(f"job {job_id} is unknown to Slurm (finished long ago, or never existed)")
        return jobs[0]

    def launch_step(self, spec: StepSpec, launcher_log: Path) -> int:
        env = {**os.environ, **spec.env} if spec.env else None
        return spawn_detached(build_srun_argv(spec), log_path=launcher_log, env=env)

    def signal_step(self, job_id: int, step_id: str, signal_name: str) -> None:
        name = step_signal_name(signal_name)
        # scancel 22.05 exits 225 ("Invalid job id specified") after delivering a signal to a
        # step, and 0 for a step that does not exist: its exit code says nothing here. Delivery
        # is confirmed by the next listing (the step drains and ends), so only a failure to run
        # scancel at all is an error.
        result = run_command(
            ["scancel", f"--signal={name}", f"{int(job_id)}.{step_id}"],
            timeout_s=self.timeout_s,
            check=False,
        )
        if result.returncode not in (0, 225):
            raise SlurmCommandError(list(result.argv), result.returncode, result.stdout, result.stderr)

    def cancel_step(self, job_id: int, step_id: str) -> None:
        result = run_command(["scancel", f"{int(job_id)}.{step_id}"], timeout_s=self.timeout_s, check=False)
        if result.returncode != 0 and "Invalid job id" not in result.stderr:
            raise SlurmCommandError(list(result.argv), result.returncode, result.stdout, result.stderr)

    def rpc_counts(self) -> dict[str, int]:
        """slurmctld's RPC counts by message type (``sdiag``), for benchmarks."""
        return parse_sdiag_rpc_counts(run_command(["sdiag"], timeout_s=self.timeout_s).stdout)


def set_job_comment(job_id: int, comment: str, timeout_s: float | None = None) -> None:
    """Record ``comment`` on the job (how the CLI finds a job's state directory from its id)."""
    run_command(["scontrol", "update", f"JobId={int(job_id)}", f"Comment={comment}"], timeout_s=timeout_s)
