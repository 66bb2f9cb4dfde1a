"""A client inside the job finds its controller from the environment (Trainer.from_env, Router.from_env)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from slurm_elastic.client import locate as locate_module
from slurm_elastic.client.locate import JobHandle, controller_from_env
from slurm_elastic.errors import ConfigError, ControllerUnreachableError
from slurm_elastic.router import Router


def state_dir(tmp_path: Path, url: str = "http://127.0.0.1:9", token: str = "t0k") -> Path:
    (tmp_path / "controller.json").write_text(json.dumps({"url": url, "pid": 1}))
    (tmp_path / "token").write_text(token + "\n")
    return tmp_path


def test_the_state_directory_names_url_and_token(tmp_path: Path) -> None:
    where = controller_from_env({"SLURM_ELASTIC_STATE_DIR": str(state_dir(tmp_path))})
    assert (where.url, where.token, where.state_dir) == ("http://127.0.0.1:9", "t0k", tmp_path)


def test_the_job_id_alone_finds_the_state_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    found = state_dir(tmp_path)
    monkeypatch.setattr(locate_module, "locate",
                        lambda job_id: JobHandle(job_id, found, "http://127.0.0.1:9", "t0k", {}))
    where = controller_from_env({"SLURM_JOB_ID": "42"})
    assert (where.url, where.token, where.state_dir) == ("http://127.0.0.1:9", "t0k", found)


def test_url_and_token_variables_win_and_need_no_state_directory(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def nowhere(job_id: int) -> JobHandle:
        raise ControllerUnreachableError(f"no controller found for job {job_id}")

    monkeypatch.setattr(locate_module, "locate", nowhere)
    where = controller_from_env({"SLURM_JOB_ID": "42", "SLURM_ELASTIC_CONTROLLER_URL": "http://10.0.0.1:8000",
                                 "SLURM_ELASTIC_TOKEN": "direct"})
    assert (where.url, where.token, where.state_dir) == ("http://10.0.0.1:8000", "direct", None)
    with pytest.raises(ControllerUnreachableError, match="no controller found for job 42"):
        controller_from_env({"SLURM_JOB_ID": "42"})  # nothing else to go on: Slurm's word is the error
    overridden = controller_from_env({"SLURM_ELASTIC_STATE_DIR": str(state_dir(tmp_path)),
                                      "SLURM_ELASTIC_CONTROLLER_URL": "http://10.0.0.1:8000"})
    assert (overridden.url, overridden.token) == ("http://10.0.0.1:8000", "t0k")


def test_nothing_to_go_on_or_no_token_says_what_to_set(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("run inside the job (SLURM_JOB_ID), or set SLURM_ELASTIC_STATE_DIR")):
        controller_from_env({})
    empty = state_dir(tmp_path, token="")
    with pytest.raises(ConfigError, match=re.escape(f"token file {empty / 'token'} is missing or empty, and so is its copy")):
        controller_from_env({"SLURM_ELASTIC_STATE_DIR": str(empty)})


def test_a_router_finds_its_controller_as_the_trainer_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    found = state_dir(tmp_path)
    monkeypatch.setattr(locate_module, "locate",
                        lambda job_id: JobHandle(job_id, found, "http://127.0.0.1:9", "t0k", {}))
    for name in ("SLURM_ELASTIC_STATE_DIR", "SLURM_ELASTIC_CONTROLLER_URL", "SLURM_ELASTIC_TOKEN",
                 "SLURM_ELASTIC_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    with Router.from_env() as router:
        assert router.state_dir == found
