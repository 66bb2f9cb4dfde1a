"""The default backend: Slurm's own command-line tools, with machine-readable output."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from slurm_elastic.core.burst import burst_job_name, parent_of_comment
from slurm_elastic.errors import SlurmCommandError, SlurmError
from slurm_elastic.slurm.backend import StepSpec, build_srun_argv, step_signal_name
from slurm_elastic.slurm.parse import (
    JOB_FORMAT,
    NODE_FORMAT,
    STEP_FORMAT,
    JobInfo,
    NodeState,
    QueuedJob,
    StepInfo,
    maintenance_reasons,
    parse_job_lines,
    parse_jobs_json,
    parse_node_lines,
    parse_sdiag_rpc_counts,
    parse_step_lines,
)
from slurm_elastic.slurm.runner import run_command, spawn_detached
from slurm_elastic.slurm.scontrol_job import job_info_from_scontrol, parse_scontrol_job_gpus

log = logging.getLogger(__name__)
NO_JSON_SIGNS = ("application/json", "unrecognized option", "invalid option")  # squeue --json is not there



class SlurmCli:
    """Slurm through ``squeue``/``sinfo``/``scontrol``/``srun``/``scancel`` (and ``sdiag`` for benchmarks).

    Steps are listed with one ``squeue --steps --format`` call: on Slurm 22.05 ``squeue --json``
    ignores ``--steps`` and prints jobs only, so the JSON path cannot list steps there.
    """

    name = "cli"

    def __init__(self, timeout_s: float | None = None, squeue_json: bool = True) -> None:
        self.timeout_s = timeout_s  # None: the runner's command timeout (controller.slurm_timeout_s)
        self._json = squeue_json  # squeue --json works here (until it says otherwise)

    def list_steps(self, job_id: int) -> list[StepInfo]:
        result = run_command(
            ["squeue", "--steps", f"--jobs={int(job_id)}", "--noheader", f"--format={STEP_FORMAT}"],
            timeout_s=self.timeout_s,
        )
        return [s for s in parse_step_lines(result.stdout) if s.job_id == job_id]

    def list_steps_of(self, job_ids: Sequence[int]) -> list[StepInfo]:
        wanted = {int(j) for j in job_ids}
        result = run_command(
            ["squeue", "--steps", f"--jobs={','.join(str(j) for j in sorted(wanted))}", "--noheader",
             f"--format={STEP_FORMAT}"],
            timeout_s=self.timeout_s,
        )
        return [s for s in parse_step_lines(result.stdout) if s.job_id in wanted]

    def job_info(self, job_id: int) -> JobInfo:
        """From ``squeue --json``; where this Slurm has none, from ``scontrol show job -d`` (said once)."""
        if not self._json:
            return job_info_from_scontrol(_show_job(job_id, self.timeout_s))
        try:
            result = run_command(["squeue", "--json", f"--jobs={int(job_id)}"], timeout_s=self.timeout_s)
        except SlurmCommandError as exc:
            if "Invalid job id" in exc.stderr:
                raise _unknown_job(job_id) from None
            if not any(sign in exc.stderr for sign in NO_JSON_SIGNS):
                raise
            log.info("squeue has no --json here (%s): job details come from scontrol show job",
                     exc.stderr.strip().splitlines()[-1] if exc.stderr.strip() else exc)
            self._json = False
            return self.job_info(job_id)
        jobs = [j for j in parse_jobs_json(result.stdout) if j.job_id == job_id]
        if not jobs:
            raise _unknown_job(job_id)
        return jobs[0]

    def set_job_comment(self, job_id: int, comment: str) -> None:
        set_job_comment(job_id, comment, timeout_s=self.timeout_s)

    def node_states(self, nodes: Sequence[str]) -> dict[str, NodeState]:
        if not nodes:
            return {}
        result = run_command(["sinfo", "--Node", "--noheader", f"--nodes={','.join(sorted(nodes))}",
                              f"--Format={NODE_FORMAT}"], timeout_s=self.timeout_s)
        wanted = set(nodes)
        return self.with_maintenance_reasons(
            {name: node for name, node in parse_node_lines(result.stdout).items() if name in wanted})

    def with_maintenance_reasons(self, states: dict[str, NodeState]) -> dict[str, NodeState]:
        """``states`` with the reservation named where a maintenance reservation holds a node and
        Slurm gives no reason (one ``scontrol`` call, only then; unchanged if it fails: the node
        is out of use whatever the reason says)."""
        held = [n.name for n in states.values()
                if not n.reason and {"maint", "maintenance"} & set(n.state.split("+"))]
        if not held:
            return states
        try:
            listing = run_command(["scontrol", "show", "reservation", "--oneliner"], timeout_s=self.timeout_s).stdout
        except SlurmError as exc:
            log.warning("could not name the maintenance reservation on %s: %s", ", ".join(held), exc)
            return states
        reasons = maintenance_reasons(listing, held)
        return {name: NodeState(name, node.state, reasons[name]) if name in reasons else node
                for name, node in states.items()}

    def launch_step(self, spec: StepSpec, launcher_log: Path) -> int:
        env = {**step_launch_environ(os.environ, spec.job_id), **spec.env}
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

    def submit_batch(self, script: Path) -> int:
        result = run_command(["sbatch", "--parsable", str(script)], timeout_s=self.timeout_s,
                             env=step_launch_environ(os.environ, None))
        first = result.stdout.strip().split(";")[0]
        if not first.isdigit():
            raise SlurmError(f"sbatch --parsable printed {result.stdout.strip()!r}, not a job id")
        return int(first)

    def list_jobs_named(self, name: str, user: str | None = None) -> list[QueuedJob]:
        # squeue --json lists every job of the cluster on 22.05 (it ignores --name and --jobs): the
        # format listing is filtered by Slurm and stays small.
        who = f"--user={user}" if user else "--me"
        result = run_command(["squeue", who, f"--name={name}", "--noheader", f"--format={JOB_FORMAT}"],
                             timeout_s=self.timeout_s)
        return [j for j in parse_job_lines(result.stdout) if j.name == name]

    def list_my_jobs(self) -> list[QueuedJob]:
        result = run_command(["squeue", "--me", "--noheader", f"--format={JOB_FORMAT}"], timeout_s=self.timeout_s)
        return parse_job_lines(result.stdout)

    def list_jobs(self, job_ids: Sequence[int]) -> list[QueuedJob]:
        if not job_ids:
            return []
        wanted = {int(j) for j in job_ids}
        result = run_command(["squeue", f"--jobs={','.join(str(j) for j in sorted(wanted))}", "--noheader",
                              f"--format={JOB_FORMAT}"], timeout_s=self.timeout_s, check=False)
        if result.returncode != 0:  # every id unknown: "Invalid job id specified"
            if "Invalid job id" in result.stderr:
                return []
            raise SlurmCommandError(list(result.argv), result.returncode, result.stdout, result.stderr)
        return [j for j in parse_job_lines(result.stdout) if j.job_id in wanted]

    def shrink_job(self, job_id: int, nodes: Sequence[str]) -> None:
        run_command(["scontrol", "update", f"JobId={int(job_id)}", f"NodeList={','.join(nodes)}"],
                    timeout_s=self.timeout_s)

    def set_job_name(self, job_id: int, name: str) -> None:
        run_command(["scontrol", "update", f"JobId={int(job_id)}", f"JobName={name}"], timeout_s=self.timeout_s)

    def cancel_job(self, job_id: int) -> None:
        result = run_command(["scancel", str(int(job_id))], timeout_s=self.timeout_s, check=False)
        if result.returncode != 0 and "Invalid job id" not in result.stderr:
            raise SlurmCommandError(list(result.argv), result.returncode, result.stdout, result.stderr)

    def cancel_burst_jobs(self, parent_job_id: int, user: str | None = None) -> list[int]:
        """Cancel the burst jobs of ``parent_job_id`` Slurm still lists (named and commented for
        it, docs/burst.md), a COMPLETING one too: Slurm lists a job it requeues COMPLETING first,
        and a cancel then stops the requeue. Returns the ids of those not already ending (a
        COMPLETING one the controller gave back as it drained is not reported again)."""
        listed = [j for j in self.list_jobs_named(burst_job_name(parent_job_id), user=user)
                  if parent_of_comment(j.comment) == parent_job_id]
        for job in listed:
            self.cancel_job(job.job_id)
        return [j.job_id for j in listed if j.state != "COMPLETING"]

    def rpc_counts(self) -> dict[str, int]:
        """slurmctld's RPC counts by message type (``sdiag``), for benchmarks."""
        return parse_sdiag_rpc_counts(run_command(["sdiag"], timeout_s=self.timeout_s).stdout)


def step_launch_environ(environ: Mapping[str, str], job_id: int | None) -> dict[str, str]:
    """The environment to run ``srun --jobid=job_id`` (or sbatch, ``job_id`` None) with: inside
    another job, that job's ``SLURM_*`` variables are dropped (``SLURM_CONF`` kept). srun does not
    replace them when it joins another job, so a step there would see the caller's
    ``SLURM_JOB_NODELIST``, ``SLURM_JOB_GPUS``, ``SLURM_JOB_CPUS_PER_NODE``; sbatch would carry them
    into the new job's script."""
    own = environ.get("SLURM_JOB_ID", "")
    if not own or (job_id is not None and own == str(job_id)):
        return dict(environ)
    return {k: v for k, v in environ.items()
            if not (k.startswith(("SLURM_", "SLURMD_")) and not k.startswith("SLURM_ELASTIC_")) or k == "SLURM_CONF"}


def set_job_comment(job_id: int, comment: str, timeout_s: float | None = None) -> None:
    """Record ``comment`` on the job (how the CLI finds a job's state directory from its id)."""
    run_command(["scontrol", "update", f"JobId={int(job_id)}", f"Comment={comment}"], timeout_s=timeout_s)


def job_gpus_by_node(job_id: int, timeout_s: float | None = None) -> dict[str, tuple[int, ...]]:
    """The GPU indexes ``job_id`` holds on each node, from ``scontrol show job -d`` (this one job;
    ``squeue --json`` lists the whole cluster on 22.05). Raises SlurmError for an unknown job."""
    return parse_scontrol_job_gpus(_show_job(job_id, timeout_s))


def _unknown_job(job_id: int) -> SlurmError:
    return SlurmError(f"job {job_id} is unknown to Slurm (finished long ago, or never existed)")


def _show_job(job_id: int, timeout_s: float | None) -> str:
    """``scontrol show job -d ID``; SlurmError for an unknown job."""
    try:
        return run_command(["scontrol", "show", "job", "-d", str(int(job_id))], timeout_s=timeout_s).stdout
    except SlurmCommandError as exc:
        if "Invalid job id" in exc.stderr:
            raise _unknown_job(job_id) from None
        raise
