"""Rendered batch scripts: golden files, and the shipped example kept in sync with its config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.controller.config import load_config, parse_config
from slurm_elastic.errors import ConfigError
from slurm_elastic.render import render_sbatch

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data" / "render"


def test_minimal_config_matches_its_golden_file() -> None:
    text = render_sbatch(load_config(DATA / "minimal.toml"), "tests/unit/data/render/minimal.toml")
    assert text == (DATA / "minimal.sbatch").read_text()
    assert "#SBATCH --cpus-per-task=8" in text and "#SBATCH --time=01:00:00" in text
    assert "python train.py --lr 3e-4" in text and "--drain-timeout-s 45" in text


def test_the_example_is_one_rendered_instance() -> None:
    result = CliRunner().invoke(main, ["render", "--config", "examples/elastic.toml"])
    assert result.exit_code == 0, result.output
    assert result.output == (REPO / "examples" / "elastic_rl.sbatch").read_text(), (
        "examples/elastic_rl.sbatch is out of date: slurm-elastic render --config examples/elastic.toml "
        "> examples/elastic_rl.sbatch")


def test_the_config_may_be_named_as_the_argument_and_a_relative_one_survives_the_set_ups_cd(tmp_path: Path) -> None:
    by_argument = CliRunner().invoke(main, ["render", "examples/elastic.toml"])
    assert by_argument.exit_code == 0 and by_argument.output == (REPO / "examples" / "elastic_rl.sbatch").read_text()
    neither = CliRunner().invoke(main, ["render"])
    assert neither.exit_code == 2 and "name the job's config" in neither.output
    both = CliRunner().invoke(main, ["render", "a.toml", "--config", "b.toml"])
    assert both.exit_code == 2 and "two configs named" in both.output
    config = parse_config({"job": {"trainer_command": "python train.py", "setup": "cd /"},
                           "workers": {"command": "python worker.py"}})
    script = render_sbatch(config, "cfg/job.toml")
    start = script.index("CONFIG=")
    head = script[start:script.index("supervise_controller()")]  # the config's path and the set-up
    assert "cd /" in head
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "job.toml").touch()
    out = subprocess.run(["bash", "-c", head + 'echo "$CONFIG"'], cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == f"{tmp_path}/cfg/job.toml"


def test_a_script_submitted_from_another_directory_ends_at_once_naming_its_config(tmp_path: Path) -> None:
    """A relative config path is read from the directory ``sbatch`` ran in: from another one the
    script ends before it starts anything (exit 78), naming the path and where it is looked for.
    Before, the controller's restart loop met the missing file first."""
    calls = tmp_path / "calls"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "slurm-elastic").write_text(f'#!/bin/bash\necho "$1" >> {calls}\n')
    (tmp_path / "bin" / "slurm-elastic").chmod(0o755)
    script = render_sbatch(load_config(DATA / "minimal.toml"), "cfg/job.toml")
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "TMPDIR": str(tmp_path)}
    done = subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode == 78 and not calls.exists(), done.stderr
    assert done.stderr.strip() == (f"slurm-elastic: cannot read the job's config {tmp_path}/cfg/job.toml: submit this "
                                   "script from the directory cfg/job.toml is relative to, or render it with an "
                                   "absolute path")


def test_an_output_that_cannot_be_written_is_one_line_and_exit_1(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["render", "examples/elastic.toml", "--output", str(tmp_path / "no" / "x")])
    assert result.exit_code == 1
    assert result.output.strip() == (f"slurm-elastic: error: cannot write the batch script to {tmp_path / 'no' / 'x'}: "
                                     "No such file or directory"), result.output


def test_the_trainer_step_gets_its_memory_where_the_job_sets_one() -> None:
    """A step without --mem in a job with --mem takes the job's whole memory on its node (Slurm
    22.05: the trainer step showed mem=2000M of 2000, and no worker step could start)."""
    config = parse_config({"job": {"trainer_command": ["python", "t.py"], "mem_per_node_mb": 2000,
                                   "trainer_mem_mb": 500},
                           "workers": {"command": "python w.py", "mem_per_worker_mb": 300}})
    script = render_sbatch(config, "x.toml")
    assert "#SBATCH --mem=2000\n" in script and " --mem=500M --job-name=se-trainer" in script


def test_a_trainer_without_gpus_names_none() -> None:
    """A step that names no GRES holds all of its node's (Slurm's default): no worker could start there."""
    def trainer_line(gpus: int) -> str:
        config = parse_config({"job": {"trainer_command": "python t.py", "trainer_gpus": gpus},
                               "workers": {"command": "python w.py"}})
        return next(line for line in render_sbatch(config, "x.toml").splitlines() if "--job-name=se-trainer" in line)
    assert " --gres=none " in trainer_line(0)
    assert " --gres=gpu:2 " in trainer_line(2)


def test_render_needs_a_trainer() -> None:
    with pytest.raises(ConfigError, match=r"job\.trainer_command is empty"):
        render_sbatch(parse_config({}), "x.toml")


def test_render_needs_a_worker_command_and_a_trainer_that_fits_a_node() -> None:
    with pytest.raises(ConfigError, match=r"workers\.command is empty"):
        render_sbatch(parse_config({"job": {"trainer_command": ["python", "t.py"]}}), "x.toml")
    with pytest.raises(ConfigError, match=r"job\.trainer_gpus \(9\) > job\.gpus_per_node \(4\)"):
        render_sbatch(parse_config({"job": {"trainer_command": ["python", "t.py"], "trainer_gpus": 9},
                                    "workers": {"command": "python w.py"}}), "x.toml")


@pytest.mark.parametrize(("job", "workers", "says"), [
    # docs/servers.md's 8-GPU server on 2 x 4 GPUs with the default trainer_gpus = 1: no server ever started
    ({}, {"gpus_per_worker": 8}, r"job\.trainer_gpus = 1 leaves 3 of its node's 4 \(job\.nodes = 2\); "
                                  r"set job\.trainer_gpus = 0 \(a trainer without GPUs\) or job\.nodes = 3"),
    ({"nodes": 1, "trainer_gpus": 3}, {"gpus_per_worker": 2}, r"set job\.trainer_gpus to at most 2 or job\.nodes = 2"),
])
def test_render_refuses_a_job_where_no_worker_fits_beside_the_trainer(job: dict[str, Any], workers: dict[str, Any],
                                                                      says: str) -> None:
    doc = {"job": {"trainer_command": ["t"], **job}, "workers": {"command": "w", **workers}}
    with pytest.raises(ConfigError, match="no worker could ever start: .*" + says):
        render_sbatch(parse_config(doc), "x.toml")
    assert render_sbatch(parse_config({**doc, "job": {**doc["job"], "trainer_gpus": 0}}), "x.toml")
    if workers["gpus_per_worker"] <= 4:  # burst jobs can hold them
        assert render_sbatch(parse_config({**doc, "burst": {"max_jobs": 1}}), "x.toml")


def test_render_refuses_workers_that_do_not_fit_in_the_nodes_memory() -> None:
    """3 workers of 30 GB beside a trainer of 40 GB need 130 GB of a 100 GB node: before, the job
    ran and those worker steps waited for memory that never came."""
    def job(**memory: int) -> dict[str, dict[str, object]]:
        return {"job": {"trainer_command": ["python", "t.py"], "nodes": 2, "gpus_per_node": 4, "trainer_mem_mb": memory.get("trainer", 40_000),
                        "mem_per_node_mb": memory.get("node", 100_000)},
                "workers": {"command": "python w.py", "mem_per_worker_mb": memory.get("worker", 30_000)}}
    with pytest.raises(ConfigError, match=r"40000\) \+ 3 workers of workers\.mem_per_worker_mb \(30000\) = 130000 MB > "
                                          r"job\.mem_per_node_mb \(100000\)"):
        render_sbatch(parse_config(job()), "x.toml")
    with pytest.raises(ConfigError, match=r"4 workers of workers\.mem_per_worker_mb \(30000\) = 120000 MB > "
                                          r"job\.mem_per_node_mb \(110000\)"):
        render_sbatch(parse_config(job(node=110_000, trainer=10_000)), "x.toml")
    assert "#SBATCH --mem=130000" in render_sbatch(parse_config(job(node=130_000)), "x.toml")


def test_shell_quoting_of_arguments() -> None:
    config = parse_config({"job": {"trainer_command": ["python", "t.py", "--name", "a b; rm -rf /"]},
                           "workers": {"command": "python w.py"}})
    assert "python t.py --name 'a b; rm -rf /'" in render_sbatch(config, "my config.toml")
    assert "CONFIG='my config.toml'" in render_sbatch(config, "my config.toml")


def run_script_with_stand_ins(tmp: Path, controller: str, wait_ready_s: float,
                              srun: str) -> subprocess.CompletedProcess[str]:
    """The rendered minimal script run by bash, with ``slurm-elastic`` and ``srun`` replaced by
    stand-ins: each call's first word goes to ``tmp/calls``; ``controller`` and ``srun`` are
    their shell bodies, ``wait-ready`` sleeps ``wait_ready_s``."""
    bin_dir, calls = tmp / "bin", tmp / "calls"
    bin_dir.mkdir()
    (bin_dir / "slurm-elastic").write_text(
        f'#!/bin/bash\necho "$1" >> {calls}\n'
        f'case "$1" in controller) {controller} ;;\n'
        f'  wait-ready) exec sleep {wait_ready_s} </dev/null >/dev/null 2>&1 ;; esac\n')
    (bin_dir / "srun").write_text(f"#!/bin/bash\n{srun}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    script = tmp / "job.sbatch"
    script.write_text(render_sbatch(load_config(DATA / "minimal.toml"), "minimal.toml"))
    (tmp / "minimal.toml").write_bytes((DATA / "minimal.toml").read_bytes())
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "TMPDIR": str(tmp)}
    return subprocess.run(["bash", str(script)], env=env, cwd=tmp, capture_output=True, text=True, timeout=60)


def test_a_configuration_error_ends_the_job_instead_of_restarting_the_controller(tmp_path: Path) -> None:
    """The rendered script with stand-ins for slurm-elastic and srun: a controller that exits 78
    (a configuration error) is started once and the script ends before the trainer step."""
    calls = tmp_path / "calls"
    result = run_script_with_stand_ins(
        tmp_path, controller='echo "slurm-elastic: error: bad key" >&2; exit 78', wait_ready_s=5,
        srun=f"echo srun >> {calls}")
    assert result.returncode == 78  # Slurm shows ExitCode=78:0, not a job killed by SIGTERM (0:15)
    assert "configuration is refused" in result.stderr
    assert calls.read_text().split() == ["controller", "wait-ready"] or calls.read_text().split() == [
        "wait-ready", "controller"]


def test_a_controller_that_keeps_failing_at_once_is_restarted_ever_more_slowly(tmp_path: Path) -> None:
    """A controller that refuses a damaged store exits 1 at once: restarted after 2, 4, 8 s ...
    (before, every 2 s for as long as the job ran: 37 restarts in a live audit)."""
    calls = tmp_path / "calls"
    result = run_script_with_stand_ins(tmp_path, controller="exit 1", wait_ready_s=3,
                                       srun='touch "$SLURM_ELASTIC_STOP"')  # the trainer ends: stop
    assert "restarting in 2 s" in result.stderr and "restarting in 4 s" in result.stderr, result.stderr
    assert calls.read_text().split().count("controller") == 2  # at 0 and 2 s; the next would be at 6 s


def test_a_controller_without_a_worker_command_stops_at_once_with_the_key(tmp_path: Path) -> None:
    """Not at every launch: an empty command would crash every worker step (`slurm-elastic worker --`)."""
    (tmp_path / "elastic.toml").write_text("[workers]\ninitial_workers = 1\n")
    result = subprocess.run([sys.executable, "-m", "slurm_elastic", "controller", "--config",
                             str(tmp_path / "elastic.toml")], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    assert result.returncode == 78 and "workers.command is empty" in result.stderr, result.stderr


@pytest.mark.parametrize("trainer_status", [0, 3])
def test_a_failed_trainer_still_drains_and_stops_and_its_status_is_the_jobs(tmp_path: Path,
                                                                           trainer_status: int) -> None:
    """The batch script's control flow, run by bash with ``srun`` and ``slurm-elastic`` replaced by
    scripts that log their calls (what they do in Slurm is tested on the dev cluster). Before, a
    trainer that exited non-zero ended the script at once (``set -e``): no drain, no stop."""
    text = render_sbatch(load_config(DATA / "minimal.toml"), "tests/unit/data/render/minimal.toml")
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name, body in {"srun": f'echo "srun $*" >> {calls}; exit {trainer_status}',
                       "slurm-elastic": f'echo "slurm-elastic $1" >> {calls}; [ "$1" != controller ] || sleep 0.2'}.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "TMPDIR": str(tmp_path)}
    done = subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == trainer_status, done.stderr
    logged = calls.read_text().splitlines()
    trainer = max(i for i, c in enumerate(logged) if c.startswith("srun "))  # the controller's stub logs
    assert "slurm-elastic stop" in logged[trainer + 1:]  # in the background: on a loaded machine, late
    assert ("the trainer exited with status 3" in done.stderr) == (trainer_status == 3)


def test_a_job_with_burst_jobs_cancels_those_still_pending_when_it_is_terminated(tmp_path: Path) -> None:
    """A burst job held while pending outlived its cancelled parent (a live audit): it never starts,
    so it never looks whether its parent still runs. The batch script's SIGTERM trap cancels the
    pending ones; a job without [burst] keeps the default (no scancel)."""
    import contextlib
    import signal
    import time

    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"srun": "sleep 1", "scancel": f'echo "scancel $*" >> {calls}',
                       "slurm-elastic": '[ "$1" != controller ] || exec sleep 30'}.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    config = load_config(DATA / "burst.toml")
    config = config.model_copy(update={"job": config.job.model_copy(update={"trainer_command": ["train"]})})
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(config, "burst.toml"))
    (tmp_path / "burst.toml").write_bytes((DATA / "burst.toml").read_bytes())
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "TMPDIR": str(tmp_path)}
    job = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(0.5)  # in the trainer step (srun)
    job.send_signal(signal.SIGTERM)
    try:
        assert job.wait(timeout=30) == 143
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)  # the controller stand-in
    assert calls.read_text() == "scancel --state=PENDING --name=elastic-burst-7\n"
    assert "scancel --state=PENDING" not in render_sbatch(load_config(DATA / "minimal.toml"), "minimal.toml")


@pytest.mark.parametrize(("extra", "says"), [
    # 2 nodes x 4 GPUs, the trainer's 1 GPU: 7 workers of 1 GPU; before, min_workers = 8 rendered and the
    # controller kept asking for the eighth worker, which no GPU could ever hold
    ({"autoscaler": {"min_workers": 8}}, r"autoscaler\.min_workers = 8 workers can never all be placed: .* hold at "
                                         r"most 7 of workers\.gpus_per_worker = 1; the controller would wait for the "
                                         r"other 1 for ever\. Set autoscaler\.min_workers to at most 7"),
    ({"autoscaler": {"enabled": False}, "workers": {"initial_workers": 9}},
     r"workers\.initial_workers = 9 workers can never all be placed: .*at most 7"),  # the fixed pool
    ({"autoscaler": {"min_workers": 2}, "workers": {"gpus_per_worker": 8}, "job": {"trainer_gpus": 0}},
     r"autoscaler\.min_workers = 2 .* hold at most 1 of workers\.gpus_per_worker = 8"),  # one worker over both nodes
    # the controller's GPUs per node, as the config's load and the controller take them (before: the job's)
    ({"autoscaler": {"min_workers": 4}, "controller": {"gpus_per_node": 2}},
     r"job\.nodes = 2 node\(s\) of controller\.gpus_per_node = 2 GPUs, .* hold at most 3 of"),
    ({"autoscaler": {"min_workers": 10, "max_workers": 10}, "burst": {"max_jobs": 1, "gpus_per_job": 2}},
     r"at most 7 of workers\.gpus_per_worker = 1, and the burst\.max_jobs = 1 burst job\(s\) at most 2 more; .* "
     r"to at most 9"),
])
def test_render_refuses_a_floor_of_workers_the_job_can_never_place(extra: dict[str, Any], says: str) -> None:
    doc: dict[str, Any] = {"job": {"trainer_command": ["t"], "nodes": 2, "gpus_per_node": 4, "trainer_gpus": 1},
                           "workers": {"command": ["w"]}}
    for table, keys in extra.items():
        doc[table] = {**doc.get(table, {}), **keys}
    with pytest.raises(ConfigError, match=says):
        render_sbatch(parse_config(doc), "x.toml")


@pytest.mark.parametrize("extra", [
    {"autoscaler": {"min_workers": 7}},  # every GPU the trainer leaves
    {"autoscaler": {"min_workers": 9}, "burst": {"max_jobs": 1, "gpus_per_job": 2}},  # with its burst job's 2
    {"autoscaler": {"enabled": False, "min_workers": 9, "max_workers": 9}, "workers": {"initial_workers": 7}},
    {"autoscaler": {"min_workers": 64}, "workers": {"gpus_per_worker": 0}},  # CPU-only workers: no GPU bound
])
def test_a_floor_the_job_can_place_renders(extra: dict[str, Any]) -> None:
    doc: dict[str, Any] = {"job": {"trainer_command": ["t"], "nodes": 2, "gpus_per_node": 4, "trainer_gpus": 1},
                           "workers": {"command": ["w"]}}
    for table, keys in extra.items():
        doc[table] = {**doc.get(table, {}), **keys}
    assert render_sbatch(parse_config(doc), "x.toml")
