"""One job from ``scontrol show job -d`` as Slurm 22.05 prints it (recorded on the dev cluster by
data/record_scontrol_job.sh): its GPU indexes per node, and the whole JobInfo where squeue has no
``--json``."""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path

import pytest

from slurm_elastic.errors import SlurmCommandError, SlurmError
from slurm_elastic.slurm import cli_backend
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.scontrol_job import job_info_from_scontrol, parse_scontrol_job_gpus

DATA = Path(__file__).with_name("data")


@pytest.mark.parametrize(("recording", "gpus"), [
    ("scontrol_job_one_node_22.05.txt", {"node1": (0,)}),
    ("scontrol_job_two_nodes_22.05.txt", {"node1": (1, 2), "node2": (0, 1)}),
    ("scontrol_job_pending_22.05.txt", {}),
])
def test_gpu_indexes_per_node_from_a_recorded_job(recording: str, gpus: dict[str, tuple[int, ...]]) -> None:
    assert parse_scontrol_job_gpus((DATA / recording).read_text()) == gpus


def test_nodes_with_the_same_layout_share_a_line_and_typed_gpus_and_gpuless_nodes_parse() -> None:
    text = ("JobId=7 JobName=x\n   NodeList=gpu[01-02],cpu1\n"
            "     Nodes=gpu[01-02] CPU_IDs=0-7 Mem=1000 GRES=gpu:a100:2(IDX:0,3)\n"
            "     Nodes=cpu1 CPU_IDs=0 Mem=100 GRES=\n")
    assert parse_scontrol_job_gpus(text) == {"gpu01": (0, 3), "gpu02": (0, 3), "cpu1": ()}


def test_a_recorded_job_reads_whole_from_scontrol() -> None:
    """Where squeue has no --json, JobInfo comes from this text (the same fields as the JSON's;
    tests/cluster/test_backend_contract.py compares the two on a live job)."""
    info = job_info_from_scontrol((DATA / "scontrol_job_two_nodes_22.05.txt").read_text())
    assert (info.job_id, info.name, info.state, info.nodes, info.batch_host) == (
        820, "wrap", "RUNNING", ("node1", "node2"), "node1")
    assert (info.user_name, info.partition, info.comment, info.restart_count) == ("root", "debug", "", 0)
    assert info.gpus_by_node == {"node1": (1, 2), "node2": (0, 1)} and info.is_running
    assert info.submit_time_s == int(time.mktime(time.strptime("2026-11-23T16:21:55", "%Y-%m-%dT%H:%M:%S")))
    pending = job_info_from_scontrol((DATA / "scontrol_job_pending_22.05.txt").read_text())
    assert (pending.state, pending.nodes, pending.batch_host, pending.gpus_by_node) == ("PENDING", (), "", {})


@pytest.mark.parametrize(("field", "expected"), [("ExitCode=78:0", 78), ("ExitCode=0:15", None), ("", None)])
def test_an_ended_jobs_exit_code_and_output_read_from_scontrol(field: str, expected: int | None) -> None:
    text = f"JobId=9 JobName=x\n   JobState=FAILED Reason=NonZeroExitCode {field}\n   StdOut=/tmp/out-9.txt\n"
    info = job_info_from_scontrol(text)
    assert info.exit_code == expected and info.output == "/tmp/out-9.txt"


def test_a_held_job_has_its_reason_and_no_exit_code() -> None:
    text = "JobId=9 JobName=x\n   JobState=PENDING Reason=JobHeldUser Dependency=(null)\n   ExitCode=0:0\n"
    info = job_info_from_scontrol(text)
    assert (info.exit_code, info.reason) == (None, "JobHeldUser")


def test_names_and_comments_with_spaces_and_an_array_head_read_whole() -> None:
    text = ("JobId=9 ArrayJobId=9 ArrayTaskId=1 JobName=my job = v2\n   UserId=alice(1001) GroupId=x(1)\n"
            "   JobState=RUNNING Reason=None\n   Restarts=2 BatchFlag=1\n   NodeList=n1\n   BatchHost=n1\n"
            "   SubmitTime=Unknown\n   Comment=slurm-elastic:/home/alice/my dir=x \n   WorkDir=/home/alice\n")
    info = job_info_from_scontrol(text)
    assert (info.job_id, info.name, info.comment, info.user_name, info.restart_count, info.submit_time_s) == (
        9, "my job = v2", "slurm-elastic:/home/alice/my dir=x", "alice", 2, 0)
    with pytest.raises(SlurmError, match="unexpected scontrol show job output"):
        job_info_from_scontrol("slurm_load_jobs error: something\n")


# What squeue said on a Slurm 25.11.7 built without JSON support (no json-c at configure time).
NO_JSON_STDERR = "squeue: fatal: serializer_required: could not find plugin for application/json\n"


def test_the_cli_backend_reads_jobs_through_scontrol_where_squeue_has_no_json(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    calls: list[list[str]] = []

    def run(argv: list[str], **_kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        if argv[0] == "squeue":
            raise SlurmCommandError(argv, 1, "", NO_JSON_STDERR)
        return subprocess.CompletedProcess(argv, 0, (DATA / "scontrol_job_two_nodes_22.05.txt").read_text(), "")

    monkeypatch.setattr(cli_backend, "run_command", run)
    caplog.set_level(logging.INFO, logger=cli_backend.__name__)
    cli = SlurmCli()
    assert cli.job_info(820).nodes == ("node1", "node2")
    assert cli.job_info(820).gpus_by_node == {"node1": (1, 2), "node2": (0, 1)}
    assert [c[0] for c in calls] == ["squeue", "scontrol", "scontrol"]  # asked once, then not again
    said = [r.getMessage() for r in caplog.records if r.name == cli_backend.__name__]
    assert said == ["squeue has no --json here (squeue: fatal: serializer_required: could not find plugin for "
                    "application/json): job details come from scontrol show job"]  # once, with squeue's words
    monkeypatch.setattr(cli_backend, "run_command", lambda argv, **_: (_ for _ in ()).throw(
        SlurmCommandError(argv, 1, "", "squeue: error: Unable to contact slurm controller\n")))
    with pytest.raises(SlurmCommandError, match="Unable to contact"):  # any other failure is not read as "no JSON"
        SlurmCli().job_info(820)
