"""pyslurm values -> our types, and the backend selection rule: pure, on values recorded from
pyslurm 25.11.2 against Slurm 25.11.7 (tests/unit/data/pyslurm_25.11.json). No pyslurm needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_elastic.controller.runtime import foreign_gpus_by_node
from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.backend import PyslurmProbe, choose_backend, parse_slurm_version
from slurm_elastic.slurm.parse import parse_jobs_json
from slurm_elastic.slurm.pyslurm_backend import (
    gpu_tres_per_node,
    gpus_by_node_from_layout,
    job_info_from_pyslurm,
    parse_index_list,
    slurm_duration,
    step_info_from_pyslurm,
)

DATA = Path(__file__).parent / "data"
RECORDED = json.loads((DATA / "pyslurm_25.11.json").read_text())


def test_job_info_from_recorded_job_fills_gpus_per_node() -> None:
    info = job_info_from_pyslurm(4, RECORDED["jobs"]["4"])
    assert info.is_running and info.nodes == ("pnode1", "pnode2") and info.batch_host == "pnode1"
    assert info.gpus_by_node == {"pnode1": (0, 1, 2, 3), "pnode2": (0, 1, 2, 3)}
    assert info.comment == "" and info.user_name == "root" and info.partition == "debug"


def test_job_info_agrees_with_the_cli_parser_on_the_same_shape() -> None:
    cli = parse_jobs_json((DATA / "squeue_job_22.05.json").read_text())[0]
    layout = {node: {"gres": {"gpu": {"count": len(gpus), "indexes": ",".join(map(str, gpus))}}}
              for node, gpus in cli.gpus_by_node.items()}
    fields = {"name": cli.name, "state": cli.state, "allocated_nodes": ",".join(cli.nodes),
              "batch_host": cli.batch_host, "comment": cli.comment, "user_name": cli.user_name,
              "partition": cli.partition, "cluster": cli.cluster, "submit_time": cli.submit_time_s,
              "requeue_count": cli.restart_count, "start_time": cli.start_time_s, "end_time": cli.end_time_s,
              "exit_code": cli.exit_code, "exit_code_signal": 0, "standard_output": cli.output, "layout": layout}
    assert job_info_from_pyslurm(cli.job_id, fields) == cli


def test_pending_job_has_no_nodes_and_no_gpus() -> None:
    info = job_info_from_pyslurm(5, RECORDED["jobs"]["5"])
    assert info.state == "PENDING" and info.nodes == () and info.gpus_by_node == {} and info.batch_host == ""



def test_a_held_job_has_its_reason_no_exit_code_and_slurms_default_output() -> None:
    held = {**RECORDED["jobs"]["5"], "exit_code": 0, "exit_code_signal": 0, "state_reason": "JobHeldUser",
            "standard_output": None, "working_directory": "/tmp/wd"}
    info = job_info_from_pyslurm(5, held)
    assert (info.exit_code, info.reason, info.output) == (None, "JobHeldUser", "/tmp/wd/slurm-5.out")


@pytest.mark.parametrize(("layout", "expected"), [
    ({"n1": {"gres": {"gpu": {"count": 2, "indexes": "0-1"}}}}, {"n1": (0, 1)}),
    ({"n1": {"gres": {"gpu:a100": {"count": 3, "indexes": "0,2-3"}}}}, {"n1": (0, 2, 3)}),
    ({"n1": {"cpu_ids": "0-3", "memory": 100}}, {"n1": ()}),
    ({"n1": {"gres": {"shard": {"count": 4, "indexes": "0"}}}}, {"n1": ()}),
])
def test_gpus_by_node_from_layout(layout: dict[str, object], expected: dict[str, tuple[int, ...]]) -> None:
    assert gpus_by_node_from_layout(layout) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("0-3", (0, 1, 2, 3)), ("0,2", (0, 2)), ("1,0-1", (0, 1)), ("", ()), ("x", ()),
])
def test_parse_index_list(text: str, expected: tuple[int, ...]) -> None:
    assert parse_index_list(text) == expected


@pytest.mark.parametrize(("tres", "nodes", "expected"), [
    ("cpu=1,mem=100M,node=1,billing=1,gres/gpu=2", 1, "gres/gpu:2"),
    ("cpu=2,mem=200M,node=1,gres/gpu=1,gres/gpu:a100=1", 1, "gres/gpu:1"),  # the total, not total + type
])
def test_gpu_tres_per_node_from_recorded_accounted_gres(tres: str, nodes: int, expected: str) -> None:
    assert gpu_tres_per_node(RECORDED["accounted_gres"][tres], nodes) == expected


@pytest.mark.parametrize(("gres", "nodes", "expected"), [
    ({}, 1, ""), ({"gpu:a100": 1, "gpu:h100": 2}, 1, "gres/gpu:3"), ({"gpu": 4}, 2, "gres/gpu:2"),
    ({"gpu": 0}, 1, ""),
])
def test_gpu_tres_per_node_edges(gres: dict[str, int], nodes: int, expected: str) -> None:
    assert gpu_tres_per_node(gres, nodes) == expected


def test_trainer_gpus_counted_from_accounted_tres() -> None:
    """The bug: the pyslurm listing dropped TRES, so the trainer's GPUs went uncounted in placement."""
    fields = {**RECORDED["steps"]["1"], "gres": RECORDED["accounted_gres"]["cpu=1,mem=100M,node=1,billing=1,gres/gpu=2"]}
    trainer = step_info_from_pyslurm(4, 1, fields)
    assert trainer.name == "se-trainer" and trainer.tres_per_node == "gres/gpu:2"
    assert foreign_gpus_by_node([trainer]) == {"pnode1": 2}


def test_recorded_steps_without_accounting_show_why_squeue_lists_them() -> None:
    """Without gres/gpu accounted pyslurm sees no step GPUs; squeue did (hence the squeue listing)."""
    steps = {key: step_info_from_pyslurm(4, key, fields) for key, fields in RECORDED["steps"].items()}
    assert {k: s.tres_per_node for k, s in steps.items()} == {"0": "", "1": "", "batch": ""}
    assert RECORDED["squeue_steps_tres"] == {"0": "gres/gpu:1", "1": "gres/gpu:2", "batch": ""}
    assert steps["0"].nodes == ("pnode2",) and steps["0"].name == "se-w-0001" and steps["0"].num_tasks == 1
    assert steps["batch"].step_ref == "4.batch" and steps["0"].time_used == "0:03"


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0:00"), (7, "0:07"), (723, "12:03"), (3723, "1:02:03"), (176523, "2-01:02:03"),
])
def test_slurm_duration(seconds: int, text: str) -> None:
    assert slurm_duration(seconds) == text


@pytest.mark.parametrize(("text", "expected"), [
    ("slurm 25.11.7\n", (25, 11)), ("slurm-wlm 22.05.8", (22, 5)), ("25.11.2", (25, 11)), ("", None),
])
def test_parse_slurm_version(text: str, expected: tuple[int, int] | None) -> None:
    assert parse_slurm_version(text) == expected


MATCH = PyslurmProbe(pyslurm_version=(25, 11), controller_version=(25, 11), gpu_tres_accounted=True)


@pytest.mark.parametrize(("preference", "slurm", "probe", "name", "reason"), [
    ("cli", (25, 11), MATCH, "cli", "as configured"),
    ("auto", (25, 11), MATCH, "pyslurm", "pyslurm 25.11 matches Slurm; steps through the API"),
    ("auto", (25, 11), PyslurmProbe(pyslurm_version=(25, 11), controller_version=(25, 11)), "pyslurm",
     "steps through squeue"),
    ("auto", (22, 5), PyslurmProbe(error="not installed (No module named 'pyslurm')"), "cli",
     "pyslurm not installed"),
    ("auto", (22, 5), PyslurmProbe(pyslurm_version=(25, 11), controller_version=(22, 5)), "cli",
     "pyslurm 25.11 does not match slurmctld 22.05"),
    ("auto", (22, 5), MATCH, "cli", "does not match the Slurm commands on PATH (22.05)"),
    ("auto", None, MATCH, "cli", "on PATH (unknown)"),
    ("auto", (25, 11), PyslurmProbe(pyslurm_version=(25, 11), error="RPCError: Unable to contact slurm controller"),
     "cli", "cannot reach slurmctld: RPCError"),
    # pyslurm 25.11 against a 22.05 slurmctld (seen on the dev cluster): its RPCs fail, and the reason names both
    ("auto", (22, 5), PyslurmProbe(pyslurm_version=(25, 11), error="RPCError: Zero Bytes were transmitted or received"),
     "cli", "pyslurm 25.11 does not match the Slurm commands on PATH (22.05), and cannot reach slurmctld: RPCError"),
])
def test_choose_backend(preference: str, slurm: tuple[int, int] | None, probe: PyslurmProbe, name: str,
                        reason: str) -> None:
    choice = choose_backend(preference, slurm, probe)
    assert choice.name == name and reason in choice.reason
    assert choice.steps_through_api == (name == "pyslurm" and probe.gpu_tres_accounted)


def test_asking_for_pyslurm_that_does_not_match_is_an_error_with_the_reason() -> None:
    with pytest.raises(SlurmError, match=r"pyslurm backend was asked for, but pyslurm 25.11 does not match slurmctld 22.05"):
        choose_backend("pyslurm", (22, 5), PyslurmProbe(pyslurm_version=(25, 11), controller_version=(22, 5)))
    assert choose_backend("pyslurm", (25, 11), MATCH).name == "pyslurm"
    with pytest.raises(SlurmError, match="unknown Slurm backend 'pyslurmx'"):
        choose_backend("pyslurmx", (25, 11), MATCH)
