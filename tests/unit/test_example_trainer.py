"""The example's trainer (examples/trainer.py) after `slurm-elastic stop`: its next call raises
ControllerStoppedError; it writes its outputs and exits 0. Before (a live audit), the traceback
ended the trainer with status 1 and the job failed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.errors import ControllerStoppedError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trainer.py"


class StoppedController:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def publish_version(self, version: int, recovered: bool = False) -> dict[str, Any]:
        return {"version": version, "staleness_capacity": 64}

    def next_batch(self) -> None:
        raise ControllerStoppedError("the job's controller was stopped: no more batches will come")

    def close(self) -> None:
        pass


def test_the_example_trainer_ends_cleanly_when_the_controller_is_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("example_trainer", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    spec.loader.exec_module(example)
    monkeypatch.setattr(example.Trainer, "from_env", classmethod(lambda cls: StoppedController(tmp_path)))
    monkeypatch.setattr(sys, "argv", ["trainer.py", "--steps", "3"])
    example.main()  # no exception: the process would exit 0
    assert "the controller was stopped: training ends at step 0" in capsys.readouterr().out
    assert (tmp_path / "reward.csv").read_text().startswith("step,time_s,reward")
