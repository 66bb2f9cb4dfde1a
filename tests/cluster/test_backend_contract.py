"""One contract for every Slurm backend, run on a real cluster for each.

- ``cli``: the shared dev cluster (the Slurm on PATH; Debian's 22.05 here and on CI).
- ``pyslurm`` (marker ``pyslurm``): a second dev cluster run from the Slurm install named by
  ``SLURM_ELASTIC_PYSLURM_PREFIX`` (e.g. ``/opt/slurm-25.11``), beside the shared one (own
  directory, ports, node names and cluster name), with a pyslurm of the same MAJOR.MINOR in this
  environment. Skipped, with the reason, where either is missing (CI). See docs/real-cluster.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_elastic.controller.runtime import foreign_gpus_by_node
from slurm_elastic.core.slurm_nodes import out_of_use_reason
from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec, default_dir
from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.backend import SlurmBackend, StepSpec, parse_slurm_version
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.parse import StepInfo
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import wait_for

pytestmark = pytest.mark.cluster
PROBE = str(Path(__file__).with_name("probe_step.py"))
PREFIX_ENV = "SLURM_ELASTIC_PYSLURM_PREFIX"
DIR_ENV = "SLURM_ELASTIC_PYSLURM_DEVCLUSTER_DIR"
# Beside the shared cluster (16817, 16901-) and test_devcluster's small one (17817, 17901-).
PYSLURM_SPEC = {"ctld_port": 18817, "node_base_port": 18901, "node_prefix": "pnode", "cluster_name": "dev25"}


def _pyslurm_skip_reason(prefix: str) -> str:
    """Why the pyslurm tests cannot run here, or "" when they can."""
    if not prefix:
        return f"set {PREFIX_ENV}=DIR (a Slurm install matching pyslurm) to run the pyslurm backend tests"
    slurmd = Path(prefix) / "sbin" / "slurmd"
    if not os.access(slurmd, os.X_OK):
        return f"{PREFIX_ENV}={prefix} has no sbin/slurmd"
    if importlib.util.find_spec("pyslurm") is None:
        return "pyslurm is not installed (pip install '.[pyslurm]' built against that Slurm)"
    slurm = parse_slurm_version(run_command([str(slurmd), "-V"], timeout_s=10).stdout)
    found = parse_slurm_version(importlib.metadata.version("pyslurm"))
    if slurm != found:
        return f"pyslurm {found} does not match the Slurm in {prefix} ({slurm})"
    return ""


@pytest.fixture(scope="session")
def pyslurm_cluster() -> DevCluster:
    """The dev cluster of the Slurm at $SLURM_ELASTIC_PYSLURM_PREFIX: reused if up, else started."""
    prefix = os.environ.get(PREFIX_ENV, "")
    reason = _pyslurm_skip_reason(prefix)
    if reason:
        pytest.skip(reason)
    directory = Path(os.environ.get(DIR_ENV, str(default_dir().with_name("devcluster-pyslurm"))))
    spec = DevClusterSpec(dir=directory, slurm_prefix=str(Path(prefix).resolve()), **PYSLURM_SPEC)  # type: ignore[arg-type]
    cluster = DevCluster(spec)
    cluster.up(wait_s=90)
    return cluster


@pytest.fixture(scope="session")
def pyslurm_backend(pyslurm_cluster: DevCluster) -> SlurmBackend:
    from slurm_elastic.slurm.pyslurm_backend import PySlurm

    return PySlurm(str(pyslurm_cluster.conf_path))


@dataclass(frozen=True)
class Target:
    """A backend and the cluster it talks to (the process environment points at that cluster)."""

    backend: SlurmBackend
    cluster: DevCluster

    @property
    def nodes(self) -> list[str]:
        return self.cluster.spec.node_names()


@pytest.fixture
def pyslurm_target(pyslurm_cluster: DevCluster, pyslurm_backend: SlurmBackend,
                   monkeypatch: pytest.MonkeyPatch) -> Target:
    env = pyslurm_cluster.env()
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    monkeypatch.setenv("PATH", env["PATH"])  # that Slurm's srun launches the steps
    return Target(pyslurm_backend, pyslurm_cluster)


@pytest.fixture(params=["cli", pytest.param("pyslurm", marks=pytest.mark.pyslurm)])
def target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Target:
    if request.param == "pyslurm":
        return request.getfixturevalue("pyslurm_target")  # type: ignore[no-any-return]
    cluster = request.getfixturevalue("devcluster")
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf_path))
    return Target(SlurmCli(), cluster)


@contextlib.contextmanager
def allocation_on(target: Target) -> Iterator[int]:
    """A running 2-node job holding every GPU of the target's cluster; cancelled afterwards."""
    job_id = int(run_command(["sbatch", "--parsable", "--nodes=2", "--exclusive", "--gres=gpu:4", "--mem=0",
                              "--job-name=se-contract", "--output=/dev/null", "--wrap", "sleep 100000"]
                             ).stdout.strip().split(";")[0])
    try:
        wait_for(lambda: target.backend.job_info(job_id).is_running, 60, "the allocation to run")
        yield job_id
    finally:
        run_command(["scancel", str(job_id)], check=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and run_command(["squeue", "-h", "-j", str(job_id)],
                                                          check=False).stdout.strip():
            time.sleep(0.2)


@pytest.fixture
def alloc(target: Target) -> Iterator[int]:
    with allocation_on(target) as job_id:
        yield job_id


def launch_probe(target: Target, job_id: int, tmp_path: Path, name: str, hold_s: float = 60.0,
                 **kwargs: object) -> Path:
    out = tmp_path / f"{name}.json"
    spec = StepSpec(job_id=job_id, name=name, argv=(sys.executable, PROBE, str(out),
                    str(target.cluster.dir / "dev"), str(hold_s)),
                    output_path=tmp_path / f"{name}.out", **kwargs)  # type: ignore[arg-type]
    target.backend.launch_step(spec, tmp_path / f"{name}.launcher.log")
    return out


def read_probe(out: Path) -> dict[str, object]:
    wait_for(out.exists, what=f"{out.name} to be written")
    return dict(json.loads(out.read_text()))


def find_step(target: Target, job_id: int, name: str) -> StepInfo | None:
    return next((s for s in target.backend.list_steps(job_id) if s.name == name), None)


def test_job_info_names_nodes_batch_host_and_gpus(target: Target, alloc: int) -> None:
    info = target.backend.job_info(alloc)
    assert info.is_running and info.job_id == alloc and info.name == "se-contract"
    assert list(info.nodes) == target.nodes and info.batch_host in info.nodes
    assert info.gpus_by_node == {node: (0, 1, 2, 3) for node in target.nodes}  # a worker slot per GPU


def test_scontrol_reads_a_job_as_squeue_json_does(devcluster: DevCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where squeue has no --json, the CLI backend reads a job from ``scontrol show job -d``: on a
    live job, every field the JSON gives, the same (the cluster's name aside: scontrol prints none)."""
    monkeypatch.setenv("SLURM_CONF", str(devcluster.conf_path))
    with allocation_on(Target(SlurmCli(), devcluster)) as job_id:
        run_command(["scontrol", "update", f"JobId={job_id}", "Comment=slurm-elastic:/tmp/a dir"])
        from_json = SlurmCli().job_info(job_id)
        from_scontrol = SlurmCli(squeue_json=False).job_info(job_id)  # as after squeue said it has no JSON
    assert from_json.comment == "slurm-elastic:/tmp/a dir" and from_json.gpus_by_node
    assert dataclasses.replace(from_scontrol, cluster=from_json.cluster) == from_json


def test_unknown_job_is_a_clear_error_and_has_no_steps(target: Target) -> None:
    with pytest.raises(SlurmError, match="job 987654 is unknown to Slurm"):
        target.backend.job_info(987654)
    assert target.backend.list_steps(987654) == []


def test_list_steps_gives_nodes_names_and_gpus(target: Target, alloc: int, tmp_path: Path) -> None:
    first, second = target.nodes
    launch_probe(target, alloc, tmp_path, "se-trainer", gpus=2, nodelist=(first,))
    launch_probe(target, alloc, tmp_path, "se-w-0001", gpus=1, nodelist=(second,))
    wait_for(lambda: {"se-trainer", "se-w-0001"} <= {s.name for s in target.backend.list_steps(alloc)},
             what="both steps listed")
    steps = {s.name: s for s in target.backend.list_steps(alloc)}
    assert steps["se-trainer"].nodes == (first,) and steps["se-w-0001"].nodes == (second,)
    assert steps["se-trainer"].num_tasks == 1 and steps["se-trainer"].step_id.isdigit()
    assert "batch" in steps
    # what placement reads: the trainer's 2 GPUs on the first node (workers and agents are not foreign)
    assert foreign_gpus_by_node(list(steps.values())) == {first: 2}
    assert foreign_gpus_by_node([dataclasses.replace(steps["se-w-0001"], name="other")]) == {second: 1}


def test_launched_step_runs_where_asked_with_only_its_gpus(target: Target, alloc: int, tmp_path: Path) -> None:
    record = read_probe(launch_probe(target, alloc, tmp_path, "se-w-pin", hold_s=0, gpus=2,
                                     nodelist=(target.nodes[1],)))
    assert record["node"] == target.nodes[1]
    assert len(record["openable"]) == 2  # type: ignore[arg-type]


def test_signal_reaches_the_step_and_an_ended_step_is_no_error(target: Target, alloc: int, tmp_path: Path) -> None:
    out = launch_probe(target, alloc, tmp_path, "se-w-sig", gpus=1)
    read_probe(out)
    step = wait_for(lambda: find_step(target, alloc, "se-w-sig"), what="step listed")
    assert isinstance(step, StepInfo)
    target.backend.signal_step(alloc, step.step_id, "USR1")
    signals = Path(str(out) + ".signals")
    wait_for(signals.exists, what="USR1 delivered")
    assert signals.read_text() == "USR1\n"
    wait_for(lambda: find_step(target, alloc, "se-w-sig") is None, what="step to end after USR1")
    target.backend.signal_step(alloc, step.step_id, "USR1")


def test_cancel_ends_the_step_and_an_ended_step_is_no_error(target: Target, alloc: int, tmp_path: Path) -> None:
    launch_probe(target, alloc, tmp_path, "se-w-cancel", gpus=1)
    step = wait_for(lambda: find_step(target, alloc, "se-w-cancel"), what="step listed")
    assert isinstance(step, StepInfo)
    target.backend.cancel_step(alloc, step.step_id)
    wait_for(lambda: find_step(target, alloc, "se-w-cancel") is None, what="step cancelled")
    target.backend.cancel_step(alloc, step.step_id)


def test_the_jobs_comment_is_set_read_back_and_listed_with_the_job_by_name(target: Target, alloc: int) -> None:
    """What the controller and burst jobs are found by: the comment (spaces and '=' kept), and
    the listing of one user's jobs by name; an ended job cancelled again is no error."""
    comment = "slurm-elastic state=/tmp/a dir/42"
    target.backend.set_job_comment(alloc, comment)
    assert target.backend.job_info(alloc).comment == comment
    (listed,) = [j for j in target.backend.list_jobs_named("se-contract") if j.job_id == alloc]
    assert (listed.state, listed.comment, listed.name) == ("RUNNING", comment, "se-contract")
    assert target.backend.list_jobs_named("se-contract-none") == []
    target.backend.cancel_job(alloc)
    wait_for(lambda: not run_command(["squeue", "-h", "-t", "RUNNING", "-j", str(alloc)], check=False).stdout.strip(),
             30, "the job to end")
    target.backend.cancel_job(alloc)


def test_a_job_is_listed_by_id_whatever_its_name_and_renamed(target: Target, alloc: int) -> None:
    """How the controller finds a burst job someone renamed: by its id, and names it back; an unknown
    id is left out, not an error."""
    target.backend.set_job_name(alloc, "se-contract renamed")
    (listed,) = target.backend.list_jobs([alloc, 99_999_999])
    assert (listed.job_id, listed.name, listed.state) == (alloc, "se-contract renamed", "RUNNING")
    assert target.backend.list_jobs([99_999_999]) == []
    target.backend.set_job_name(alloc, "se-contract")
    assert [j.job_id for j in target.backend.list_jobs_named("se-contract")] == [alloc]
    assert alloc in [j.job_id for j in target.backend.list_my_jobs()]


def test_a_drained_node_reads_drained_with_its_reason_until_resumed(target: Target, alloc: int) -> None:
    """What the controller cordons a node on: an admin's drain under a running job, with the reason
    as given; an unknown node is left out, not an error."""
    first, second = target.nodes[:2]
    states = target.backend.node_states([first, second, "no-such-node"])
    assert set(states) == {first, second} and not any(out_of_use_reason(n, s.state, "") for n, s in states.items())
    run_command(["scontrol", "update", f"NodeName={second}", "State=DRAIN", "Reason=fan swap | ticket 7"])
    try:
        node = target.backend.node_states([second])[second]
        assert "drain" in node.state.split("+") and node.reason == "fan swap | ticket 7", node
        assert out_of_use_reason(second, node.state, node.reason) == \
            f"Slurm marks node {second} {node.state.upper()}: fan swap | ticket 7"
    finally:
        run_command(["scontrol", "update", f"NodeName={second}", "State=RESUME"], check=False)
    wait_for(lambda: out_of_use_reason(second, target.backend.node_states([second])[second].state, "") is None,
             30, f"{second} to be usable again")


@pytest.mark.parametrize("how", ["State=FAIL", "a maintenance reservation", "scontrol reboot"])
def test_a_failing_or_maintained_node_reads_out_of_use_until_released(target: Target, alloc: int, how: str) -> None:
    """The other admin actions that take a node out under a running job, as this Slurm spells them
    (22.05 says MAINTENANCE, not MAINT, for a reservation with Flags=MAINT; a reboot asked for
    under a job reads ALLOCATED+REBOOT_REQUESTED until the node is idle, and is cancelled here
    before it is)."""
    second = target.nodes[1]
    if how == "State=FAIL":
        take = ["scontrol", "update", f"NodeName={second}", "State=FAIL", "Reason=psu warning"]
        give_back = ["scontrol", "update", f"NodeName={second}", "State=RESUME"]
        said = "psu warning"
    elif how == "scontrol reboot":
        take = ["scontrol", "reboot", second]
        give_back = ["scontrol", "cancel_reboot", second]
        said = "reboot requested"
    else:
        name = f"se-maint-{os.getpid()}"
        take = ["scontrol", "create", "reservation", f"ReservationName={name}", "StartTime=now", "Duration=10",
                f"Nodes={second}", "Flags=MAINT,IGNORE_JOBS", f"Users={getpass.getuser()}"]
        give_back = ["scontrol", "delete", f"ReservationName={name}"]
        said = f"maintenance reservation {name} until "
    run_command(take)
    try:
        wait_for(lambda: out_of_use_reason(second, target.backend.node_states([second])[second].state, "")
                 is not None, 30, f"{second} out of use after {how}")
        node = target.backend.node_states([second])[second]
        assert said in node.reason, node
        if how == "scontrol reboot":
            assert "reboot_requested" in node.state.split("+"), node
    finally:
        run_command(give_back, check=False)
    wait_for(lambda: out_of_use_reason(second, target.backend.node_states([second])[second].state, "") is None,
             30, f"{second} to be usable again")


# ---- selection, and what only the pyslurm backend has ------------------------------------------
def test_shared_cluster_selects_cli_and_says_why(devcluster: DevCluster, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    from slurm_elastic.slurm.pyslurm_backend import select_backend

    monkeypatch.setenv("SLURM_CONF", str(devcluster.conf_path))
    with caplog.at_level(logging.INFO, logger="slurm_elastic.slurm.pyslurm_backend"):
        assert select_backend("auto").name == "cli"
    assert "Slurm backend: cli (pyslurm" in caplog.text  # not installed, or not this Slurm's version


@pytest.mark.pyslurm
def test_matching_cluster_selects_pyslurm(pyslurm_target: Target, caplog: pytest.LogCaptureFixture) -> None:
    from slurm_elastic.slurm.pyslurm_backend import select_backend

    with caplog.at_level(logging.INFO, logger="slurm_elastic.slurm.pyslurm_backend"):
        assert select_backend("auto").name == "pyslurm"
    assert "matches Slurm" in caplog.text


@pytest.mark.pyslurm
def test_api_step_listing_agrees_with_squeue(pyslurm_target: Target, tmp_path: Path) -> None:
    """The API listing (used where Slurm accounts gres/gpu) on everything but GPUs, which it cannot see here."""
    from slurm_elastic.slurm.pyslurm_backend import PySlurm

    target = pyslurm_target
    api = PySlurm(str(target.cluster.conf_path), steps_through_api=True)
    with allocation_on(target) as job_id:
        launch_probe(target, job_id, tmp_path, "se-w-api", gpus=1, nodelist=(target.nodes[1],))
        wait_for(lambda: find_step(target, job_id, "se-w-api"), what="step listed")

        def key(s: StepInfo) -> tuple[str, str, tuple[str, ...], int]:
            return s.step_id, s.name, s.nodes, s.num_tasks

        assert sorted(map(key, api.list_steps(job_id))) == sorted(map(key, SlurmCli().list_steps(job_id)))
    assert api.list_steps(987654) == []
