"""Pure parsers of Slurm output, on recorded 22.05 output and edge cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_elastic.errors import SlurmError, SlurmUnavailableError
from slurm_elastic.slurm.parse import (
    FIELD_SEP,
    expand_hostlist,
    parse_gres_indexes,
    parse_jobs_json,
    parse_sdiag_rpc_counts,
    parse_step_lines,
    slurm_version_of_json,
)

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[1-3,5]", ["node1", "node2", "node3", "node5"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("gpu[01-02]-ib", ["gpu01-ib", "gpu02-ib"]),
        ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("node[7]", ["node7"]),
        ("", []),
        ("(null)", []),
    ],
)
def test_expand_hostlist(expr: str, expected: list[str]) -> None:
    assert expand_hostlist(expr) == expected


@pytest.mark.parametrize("expr", ["node[1-3", "node1-3]", "node[3-1]", "node[a-b]", "node[]", "node[1,,2]"])
def test_expand_hostlist_rejects_malformed(expr: str) -> None:
    with pytest.raises(SlurmError, match="malformed hostlist"):
        expand_hostlist(expr)


def test_parse_recorded_step_listing() -> None:
    steps = parse_step_lines((DATA / "squeue_steps_22.05.txt").read_text())
    by_name = {s.name: s for s in steps}
    assert set(by_name) == {"se-w-0001", "se-w-0002", "se-w-0003", "batch"}
    assert by_name["se-w-0002"].nodes == ("node2",)
    assert by_name["se-w-0002"].tres_per_node == "gres:gpu:1"
    assert by_name["se-w-0001"].step_ref == "1.4"
    assert by_name["batch"].step_id == "batch"
    assert by_name["batch"].tres_per_node == ""


def test_step_names_may_contain_anything_but_the_separator() -> None:
    line = FIELD_SEP.join(["12.3", "node[1-2]", "1:00", "now", "(null)", "2", "odd | name, with: stuff"])
    (step,) = parse_step_lines(line + "\n")
    assert step.name == "odd | name, with: stuff"
    assert step.nodes == ("node1", "node2")
    assert step.num_tasks == 2


@pytest.mark.parametrize("line", ["garbage", FIELD_SEP.join(["x.1", "n", "", "", "", "", "nm"])])
def test_parse_step_lines_rejects_garbage(line: str) -> None:
    with pytest.raises(SlurmError):
        parse_step_lines(line)


def test_parse_recorded_job_json() -> None:
    text = (DATA / "squeue_job_22.05.json").read_text()
    (job,) = parse_jobs_json(text)
    assert job.job_id == 1
    assert job.state == "RUNNING"
    assert job.nodes == ("node1", "node2")
    assert job.batch_host == "node1"
    assert slurm_version_of_json(text) == (22, 5)
    assert job.gpus_by_node == {"node1": (0, 1, 2, 3), "node2": (0, 1, 2, 3)}


@pytest.mark.parametrize(
    ("detail", "expected"),
    [("gpu:4(IDX:0-3)", (0, 1, 2, 3)), ("gpu:a100:2(IDX:0,2)", (0, 2)), ("gpu:3(IDX:1,4-5)", (1, 4, 5)),
     ("gpu:0(IDX:N/A)", ()), ("", ())],
)
def test_parse_gres_indexes(detail: str, expected: tuple[int, ...]) -> None:
    assert parse_gres_indexes(detail) == expected


def test_parse_job_json_list_state_of_newer_slurm() -> None:
    text = '{"jobs": [{"job_id": 5, "job_state": ["RUNNING", "COMPLETING"], "nodes": "n[1-2]"}]}'
    (job,) = parse_jobs_json(text)
    assert job.state == "RUNNING" and job.nodes == ("n1", "n2")


@pytest.mark.parametrize("text", ["", "{", "[]", '{"meta": {}}'])
def test_parse_job_json_errors_are_clear(text: str) -> None:
    with pytest.raises(SlurmError, match="squeue --json"):
        parse_jobs_json(text)


def test_parse_recorded_sdiag() -> None:
    counts = parse_sdiag_rpc_counts((DATA / "sdiag_22.05.txt").read_text())
    assert counts["REQUEST_JOB_STEP_INFO"] >= 1
    assert counts["REQUEST_SUBMIT_BATCH_JOB"] >= 1
    assert all(isinstance(v, int) for v in counts.values())


def test_squeue_json_that_reports_an_error_instead_of_jobs_is_not_an_unknown_job() -> None:
    # what 22.05's `squeue --json` prints, with exit code 0, while slurmctld is down or hung
    text = ('{"meta": {"Slurm": {"release": "22.05.8"}}, "errors": [{"description": "Failed w err '
            'to load job info", "error_number": 1007, "error": "Unable to contact slurm controller '
            '(connect failure)", "source": "slurm_load_jobs"}], "jobs": []}')
    with pytest.raises(SlurmUnavailableError, match="Slurm reported an error instead of jobs"):
        parse_jobs_json(text)


@pytest.mark.parametrize(("exit_code", "expected"), [
    (19968, 78), (0, 0), (15, None),  # 22.05: a wait status (78 << 8; killed by SIGTERM)
    ({"status": ["EXITED"], "return_code": {"set": True, "number": 78}}, 78),  # 23.02 and later
    ({"status": ["SIGNALED"], "return_code": {"set": True, "number": 0}}, None), (None, None)])
def test_an_ended_jobs_exit_code_and_output_file_read_from_squeue_json(exit_code: object, expected: int | None) -> None:
    job = {"job_id": 3369, "job_state": "FAILED", "exit_code": exit_code, "standard_output": "/tmp/out-%j.txt"}
    (info,) = parse_jobs_json(json.dumps({"jobs": [job]}))
    assert info.exit_code == expected and info.output == "/tmp/out-3369.txt"


@pytest.mark.parametrize("state", ["PENDING", "RUNNING", "SUSPENDED", "REQUEUE_HOLD"])
def test_a_job_that_has_not_ended_has_no_exit_code(state: str) -> None:
    """Slurm 22.05 reports 0 for a job that has not ended: read as none, not as a clean exit."""
    job = {"job_id": 12, "job_state": state, "exit_code": 0, "state_reason": "JobHeldUser"}
    (info,) = parse_jobs_json(json.dumps({"jobs": [job]}))
    assert info.exit_code is None and info.reason == "JobHeldUser"
    (running,) = parse_jobs_json((DATA / "squeue_job_22.05.json").read_text())
    assert running.exit_code is None and running.reason == ""  # Slurm's "None": no reason


def test_a_job_that_named_no_output_file_writes_slurms_default_one() -> None:
    """What 22.05's squeue --json gives for `sbatch --wrap` in /tmp/wd without -o (seen on the dev
    cluster; scontrol shows StdOut=/tmp/wd/slurm-1253.out); an array task's default is another name."""
    job = {"job_id": 1253, "job_state": "COMPLETED", "standard_output": "", "current_working_directory": "/tmp/wd",
           "array_job_id": 0}
    (info,) = parse_jobs_json(json.dumps({"jobs": [job]}))
    assert info.output == "/tmp/wd/slurm-1253.out"
    (task,) = parse_jobs_json(json.dumps({"jobs": [{**job, "array_job_id": 1250}]}))
    assert task.output == ""
    (given,) = parse_jobs_json(json.dumps({"jobs": [{**job, "standard_output": "/tmp/wd/rel-%j.out"}]}))
    assert given.output == "/tmp/wd/rel-1253.out"
