"""The operator CLI and the API's token check against a live controller on the dev cluster."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.errors import ControllerUnreachableError
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import ControllerJob, wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(autouse=True)
def _state_root(job: ControllerJob, monkeypatch: pytest.MonkeyPatch) -> None:
    # the CLI finds the state dir from the job alone: here via the job comment the controller set
    monkeypatch.setenv("SLURM_ELASTIC_HOME", str(job.tmp / "elsewhere"))


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_status_table_and_json(job: ControllerJob) -> None:
    code, out = cli("scale", str(job.job_id), "2", "--wait", "--timeout-s", "40")
    assert code == 0, out
    code, out = cli("status", str(job.job_id))
    assert code == 0
    assert f"job {job.job_id}" in out and "controller: http://" in out
    assert "WORKER" in out and "0001" in out and "0002" in out and "ACTIVE" in out
    code, out = cli("status", str(job.job_id), "--json")
    doc = json.loads(out)
    assert doc["schema_version"] == 1 and doc["controller_reachable"] is True
    assert doc["controller"]["workers_by_state"]["ACTIVE"] == 2
    slots = doc["controller"]["usable_slots"]
    code, out = cli("scale", str(job.job_id), "40000")  # more than the job's GPUs: said, not refused
    assert code == 0 and out.startswith(f"job {job.job_id}: target 40000 workers, set by hand"), out
    assert f"\nnote: 40000 workers asked; {slots} GPU slots are usable now" in out, out
    assert f"target: 40000 workers (paused; only {slots} GPU slots usable now)" in cli("status", str(job.job_id))[1]


@pytest.mark.parametrize("job", [{"queue": {"batch_size": 8, "capacity_seqs": 32, "max_staleness": 1}}], indirect=True)
def test_status_shows_the_live_queues_buffer_line(job: ControllerJob) -> None:
    """The buffer line README shows, from a live controller's queue (submitted, pulled, acked for real)."""
    with job.client() as c:
        for version in (1, 2, 3):  # a plain publish steps at most max_staleness + 1
            c.set_version(version)
        for k in range(3):
            c.submit_group({"id": f"g{k}", "worker_id": "0001", "policy_version": 3, "group_size": 4,
                            "sequences": [{"tokens": [1, 2, 3], "score": 0.5} for _ in range(4)]})
        batch = c.pull_batch()
        assert batch is not None
        c.ack_batch(batch["batch_id"])
    doc = json.loads(cli("status", str(job.job_id), "--json")[1])
    queue = doc["controller"]["queue"]
    assert (queue["queued_sequences"], queue["capacity_sequences"], queue["policy_version"],
            queue["delivered_sequences"]) == (4, 32, 3, 8)
    code, out = cli("status", str(job.job_id))
    assert code == 0, out
    assert (f"buffer: 4/32 sequences  staleness capacity {queue['staleness_capacity']}  trainer version 3"
            "  delivered 8\n") in out


@pytest.mark.parametrize("job", [{"controller": {"allocation_check_s": 2.0}}], indirect=True)
def test_an_overwritten_job_comment_is_set_back(job: ControllerJob) -> None:
    """An operator's ``scontrol update Comment=`` hides the state directory from the CLI (and the
    epilog, and a restarted controller) until the controller's next allocation check sets it back."""
    run_command(["scontrol", "update", f"JobId={job.job_id}", "Comment=my own note"])
    code, out = cli("status", str(job.job_id))
    assert code != 0 and "Traceback" not in out, out
    wait_for(lambda: SlurmCli().job_info(job.job_id).comment == f"slurm-elastic:{job.state_dir}", 20,
             "the controller to set the comment back")
    code, out = cli("status", str(job.job_id), "--json")
    assert code == 0, out
    errors = [e["error"] for e in json.loads(out)["controller"]["errors"] if e["where"] == "comment"]
    assert len(errors) == 1 and "'my own note'" in errors[0], errors


def test_wake_all_pause_resume_drain_cordon(job: ControllerJob) -> None:
    assert cli("wake-all", str(job.job_id))[0] == 0
    job.active(8)
    assert cli("cordon", str(job.job_id), "node2:2", "--reason", "fan noise")[0] == 0
    assert cli("scale", str(job.job_id), "3", "--wait", "--timeout-s", "40")[0] == 0
    survivor = next(w["worker_id"] for w in job.status()["workers"] if w["state"] == "ACTIVE")
    code, out = cli("drain", str(job.job_id), survivor)
    assert code == 0 and f"worker {survivor} is DRAINING" in out, out
    job.active(3)  # drained worker replaced while the target is 3
    code, out = cli("status", str(job.job_id))
    assert "node2:2" in out and "fan noise" in out and "operator" in out
    assert cli("pause", str(job.job_id))[0] == 0
    assert cli("resume", str(job.job_id))[0] == 0
    assert job.status()["paused"] is False
    code, out = cli("drain", str(job.job_id), "9999")
    assert code != 0 and out.startswith("slurm-elastic: error: 9999: no worker of that id"), out
    code, out = cli("cordon", str(job.job_id), "node7:0")
    assert code != 0 and "not a GPU of job" in out
    code, out = cli("cordon", str(job.job_id), "nonsense")
    assert code != 0 and "NODE:GPU" in out


def test_unknown_job_id_is_a_clear_error(job: ControllerJob) -> None:
    code, out = cli("status", "987654")
    assert code != 0 and "job 987654 is unknown to Slurm" in out and "Traceback" not in out


def test_status_with_the_controller_down_shows_slurm_steps(job: ControllerJob) -> None:
    assert cli("scale", str(job.job_id), "2", "--wait", "--timeout-s", "40")[0] == 0
    (job.tmp / "stop").touch()  # the harness' restart loop ends
    os.kill(job.controller_pid(), signal.SIGKILL)
    def down() -> bool:
        return cli("status", str(job.job_id))[0] == 3
    wait_for(down, 20, "the controller to be down")
    code, out = cli("status", str(job.job_id))
    assert code == 3 and "UNREACHABLE" in out
    assert "se-w-0001" in out and "se-w-0002" in out  # what Slurm still runs
    code, out = cli("status", str(job.job_id), "--json")
    doc = json.loads(out)
    assert doc["controller_reachable"] is False and len(doc["slurm_steps"]) >= 3


def test_stop_from_another_host_stops_the_controller(job: ControllerJob) -> None:
    """An operator on a login node (not the batch host) stops the job's controller: the API says
    so, not a signal to a pid on this host (``controller.json`` names another host here)."""
    assert cli("scale", str(job.job_id), "1", "--wait", "--timeout-s", "40")[0] == 0
    info = json.loads((job.state_dir / "controller.json").read_text())
    (job.state_dir / "controller.json").write_text(json.dumps({**info, "host": "a-login-node"}))
    code, out = cli("stop", str(job.job_id), "--drain-timeout-s", "30")
    assert code == 0 and "controller stopped" in out, out
    assert not job.worker_steps()  # drained
    # the controller exited 0: the job's restart loop ended, and with it the job
    wait_for(lambda: not run_command(["squeue", "-h", "-j", str(job.job_id)], check=False).stdout.strip(), 30,
             "the job to end")


@pytest.mark.parametrize("job", [{"workers": {"drain_timeout_s": 3.0}, "worker_env": {"IGNORE_DRAIN": "1"}}],
                         indirect=True)
def test_stop_goes_ahead_when_a_worker_outlasts_the_drain_time(job: ControllerJob) -> None:
    """A worker that ignores the drain signal is cancelled by the controller at its drain time;
    `stop` waits for that, then stops the controller and exits 0 (the batch script's last command)."""
    assert cli("scale", str(job.job_id), "1", "--wait", "--timeout-s", "40")[0] == 0
    code, out = cli("stop", str(job.job_id), "--drain-timeout-s", "3")
    assert code == 0 and "controller stopped" in out, out
    wait_for(lambda: not run_command(["squeue", "-h", "-j", str(job.job_id)], check=False).stdout.strip(), 30,
             "the job to end")


def test_a_sigterm_to_the_controller_starts_a_new_one_that_adopts_the_workers(job: ControllerJob) -> None:
    """Only `slurm-elastic stop` ends the batch script's restart loop: a controller ended by SIGTERM
    exits 143, and the next one adopts the same worker steps."""
    assert cli("scale", str(job.job_id), "2", "--wait", "--timeout-s", "40")[0] == 0
    steps, old_pid = job.worker_steps(), job.controller_pid()
    os.kill(old_pid, signal.SIGTERM)

    def restarted() -> bool:
        try:
            return job.controller_pid() != old_pid and job.status()["workers_by_state"]["ACTIVE"] == 2
        except (OSError, ValueError, ControllerUnreachableError):
            return False

    wait_for(restarted, 60, "a new controller")
    assert job.worker_steps() == steps  # adopted, none relaunched
    assert "controller stopped by a signal" in (job.tmp / "job.out").read_text()


def test_api_requires_the_jobs_token(job: ControllerJob) -> None:
    url = json.loads((job.state_dir / "controller.json").read_text())["url"]
    assert httpx.get(f"{url}/healthz").status_code == 401
    assert httpx.get(f"{url}/openapi.json").status_code == 401
    assert httpx.get(f"{url}/controller/status").status_code == 401
    assert httpx.post(f"{url}/admin/scale", json={"workers": 5}).status_code == 401
    wrong = {"Authorization": "Bearer not-the-token"}
    assert httpx.get(f"{url}/controller/status", headers=wrong).status_code == 403
    assert httpx.post(f"{url}/admin/drain/0001", headers=wrong).status_code == 403
    token = (job.state_dir / "token").read_text().strip()
    assert oct(Path(job.state_dir / "token").stat().st_mode & 0o777) == "0o600"
    good = {"Authorization": f"Bearer {token}"}
    bad = httpx.post(f"{url}/admin/scale", headers=good, json={"workers": "many"})
    assert bad.status_code == 422 and "workers" in bad.text
    assert httpx.post(f"{url}/admin/scale", headers=good, content=b"{not json").status_code == 422
    assert job.status()["target_workers"] == 0  # nothing changed by the bad requests
