"""An ended job's token goes nowhere: on the dev cluster, a real controller job is cancelled and
another program takes its port; the operator's commands ask Slurm first and send it nothing."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main
from slurm_elastic.client.locate import CONTROLLER_MAY_RUN
from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.runner import run_command
from tests.cluster.controller_harness import ControllerJob, wait_for
from tests.recording_listener import RecordingListener

pytestmark = [pytest.mark.cluster, pytest.mark.second_cluster]


def _ended(job_id: int) -> bool:
    try:
        return SlurmCli().job_info(job_id).state not in CONTROLLER_MAY_RUN
    except SlurmError:
        return True  # purged from slurmctld's memory already


def test_an_ended_jobs_token_never_reaches_the_program_on_its_port_now(job: ControllerJob,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_ELASTIC_HOME", str(job.tmp / "elsewhere"))  # found from the job alone
    url = json.loads((job.state_dir / "controller.json").read_text())["url"]
    (job.tmp / "stop").touch()  # the batch script's restart loop ends with the controller
    run_command(["scancel", str(job.job_id)])
    wait_for(lambda: _ended(job.job_id), 60, "the job to end")
    port = int(url.rsplit(":", 1)[1])
    listener = wait_for(lambda: _listen_on(port), 30, f"port {port} to be free")
    try:
        for args in (("status", str(job.job_id)), ("pause", str(job.job_id)), ("scale", str(job.job_id), "3")):
            result = CliRunner().invoke(main, list(args))
            assert result.exit_code != 0, result.output
            assert "Traceback" not in result.output
            assert "not sending the job's token" in result.output or "unknown to Slurm" in result.output, result.output
        assert listener.connections == 0 and bytes(listener.received) == b""
    finally:
        listener.close()


def _listen_on(port: int) -> RecordingListener | None:
    try:
        return RecordingListener(port)
    except OSError:  # the controller's socket is not closed yet
        return None
