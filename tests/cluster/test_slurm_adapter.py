"""The CLI adapter against the real dev cluster: GPU pinning, one batched listing, survival of steps.

What every backend must do (job info, step listing with GPUs, launch, signal, cancel) is in
test_backend_contract.py, run there for the CLI and the pyslurm backend alike.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_elastic.devcluster.cluster import DevCluster
from slurm_elastic.slurm.backend import StepSpec
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.parse import StepInfo
from slurm_elastic.slurm.runner import command_counts
from tests.cluster.controller_harness import wait_for

pytestmark = pytest.mark.cluster
PROBE = str(Path(__file__).with_name("probe_step.py"))


def probe_spec(job_id: int, tmp_path: Path, name: str, cluster: DevCluster, hold_s: float = 60.0,
               **kwargs: object) -> tuple[StepSpec, Path]:
    out = tmp_path / f"{name}.json"
    spec = StepSpec(job_id=job_id, name=name, argv=(sys.executable, PROBE, str(out), str(cluster.dir / "dev"),
                    str(hold_s)), output_path=tmp_path / f"{name}.out", **kwargs)  # type: ignore[arg-type]
    return spec, out


def read_probe(out: Path) -> dict[str, object]:
    wait_for(out.exists, what=f"{out.name} to be written")
    return dict(json.loads(out.read_text()))


def find_step(slurm: SlurmCli, job_id: int, name: str) -> StepInfo | None:
    return next((s for s in slurm.list_steps(job_id) if s.name == name), None)


def test_each_step_opens_only_its_own_gpu(
    slurm: SlurmCli, allocation: int, devcluster: DevCluster, tmp_path: Path
) -> None:
    outs = []
    for i in range(4):
        spec, out = probe_spec(allocation, tmp_path, f"se-w-pin{i}", devcluster, hold_s=30, gpus=1,
                               nodelist=("node1",))
        slurm.launch_step(spec, tmp_path / f"launcher{i}.log")
        outs.append(out)
    records = [read_probe(o) for o in outs]
    openable = [tuple(r["openable"]) for r in records]  # type: ignore[arg-type]
    assert all(len(o) == 1 for o in openable), openable
    assert sorted(o[0] for o in openable) == [0, 1, 2, 3]  # four steps, four distinct GPUs
    for record in records:  # Slurm's view (SLURM_STEP_GPUS) names the GPU the step can open
        assert [int(g) for g in str(record["step_gpus"]).split(",")] == list(record["openable"])  # type: ignore[call-overload]


def test_list_steps_parses_live_output(
    slurm: SlurmCli, allocation: int, devcluster: DevCluster, tmp_path: Path
) -> None:
    for node in ("node1", "node2"):
        spec, _ = probe_spec(allocation, tmp_path, f"se-w-list-{node}", devcluster, gpus=1, nodelist=(node,))
        slurm.launch_step(spec, tmp_path / f"{node}.log")
    wait_for(lambda: len([s for s in slurm.list_steps(allocation) if s.name.startswith("se-w-list")]) == 2,
             what="both steps listed")
    before = command_counts().get("squeue", 0)
    steps = {s.name: s for s in slurm.list_steps(allocation)}
    assert command_counts()["squeue"] == before + 1  # one batched call for all steps
    assert steps["se-w-list-node1"].nodes == ("node1",)
    assert steps["se-w-list-node2"].nodes == ("node2",)
    assert steps["se-w-list-node2"].tres_per_node in ("gres:gpu:1", "gres/gpu:1")  # 22.05 writes ':', 25.11 '/'
    assert "batch" in steps


def _alive_at(out: Path) -> float:
    """When the probe last wrote its alive mark (it writes one every 0.2 s while it runs)."""
    return float(Path(str(out) + ".alive").read_text() or 0)


def _still_running(out: Path) -> bool:
    seen = _alive_at(out)
    return bool(wait_for(lambda: _alive_at(out) > seen, 20, "a fresh alive mark"))


def _launch_from_child(allocation: int, spec: StepSpec, log: Path) -> subprocess.Popen[bytes]:
    """A stand-in controller: a process in its own group that launches the step, then idles."""
    code = (
        "import time; from pathlib import Path; from slurm_elastic.slurm.cli_backend import SlurmCli;"
        "from slurm_elastic.slurm.backend import StepSpec;"
        f"SlurmCli().launch_step(StepSpec(job_id={allocation}, name={spec.name!r}, argv={list(spec.argv)!r},"
        f" output_path=Path({str(spec.output_path)!r}), gpus=1), Path({str(log)!r}));"
        "time.sleep(60)"
    )
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})


@pytest.mark.parametrize("kill", ["sigkill-launcher", "sigterm-launcher-group"])
def test_step_survives_the_death_of_its_launcher(
    slurm: SlurmCli, allocation: int, devcluster: DevCluster, tmp_path: Path, kill: str
) -> None:
    spec, out = probe_spec(allocation, tmp_path, f"se-w-{kill}", devcluster, gpus=1)
    parent = _launch_from_child(allocation, spec, tmp_path / "launcher.log")
    read_probe(out)
    step = wait_for(lambda: find_step(slurm, allocation, spec.name), what="step listed")
    if kill == "sigkill-launcher":
        os.kill(parent.pid, signal.SIGKILL)
    else:
        os.killpg(parent.pid, signal.SIGTERM)  # what a dying controller's process group gets
    parent.wait(timeout=10)
    time.sleep(3.0)
    again = find_step(slurm, allocation, spec.name)
    assert isinstance(step, StepInfo) and again is not None
    assert again.step_ref == step.step_ref  # found again by listing, same step
    assert _still_running(out)  # and its process is still running


def test_sigkill_of_srun_itself_cancels_the_step(
    slurm: SlurmCli, allocation: int, devcluster: DevCluster, tmp_path: Path
) -> None:
    """Documented behaviour: srun's shepherd cancels the step when srun is SIGKILLed.

    So slurm-elastic never kills an srun; it runs srun in its own session, where the
    controller's death and signals to the controller's process group do not reach it.
    """
    spec, out = probe_spec(allocation, tmp_path, "se-w-srunkill", devcluster, gpus=1)
    pid = slurm.launch_step(spec, tmp_path / "launcher.log")
    read_probe(out)
    wait_for(lambda: find_step(slurm, allocation, spec.name), what="step listed")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: find_step(slurm, allocation, spec.name) is None, timeout_s=30, what="step cancelled")
