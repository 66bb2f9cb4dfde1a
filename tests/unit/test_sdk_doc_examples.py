"""docs/sdk.md's two code blocks run as written: the worker block in two processes under one
worker id (the two tasks of a step with ``workers.tasks_per_node = 2``), the trainer block beside
them, against the controller's real API and store; only the names the page says are the user's
are defined first. Before, the worker block named its groups ``f"{worker_id}-{n}"`` with ``n``
never set: defined as 0 (what a user adds), every group after a worker's first, and every group
of the second task, was dropped as an id stored before, and the trainer waited for ever; the
trainer block took ``next_batch()``'s None (no batch in ``timeout_s``) for a batch."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.served_controller import ServedController

REPO = Path(__file__).resolve().parents[2]
TOKEN = "doc-token"
STEPS = 3

WORKER_PRELUDE = """
import os, pathlib, time
GROUP = 4
WEIGHTS = pathlib.Path(os.environ["DOC_WEIGHTS"])
def newest_weights_version():
    return int(WEIGHTS.read_text()) if WEIGHTS.exists() else 0
def generate_and_score(version):
    time.sleep(0.02)
    with open(os.environ["DOC_MADE"], "a") as made:
        made.write("group\\n")
    return [{"tokens": [1, 2, 3], "score": 0.5} for _ in range(GROUP)]
"""

TRAINER_PRELUDE = """
import os, pathlib
steps = {steps}
def load_checkpoint():
    return 0
def train_on(groups):
    print("trained on", len(groups), "groups", flush=True)
def save_weights(version):  # whole or not at all: a worker reads it at any moment
    weights = pathlib.Path(os.environ["DOC_WEIGHTS"])
    weights.with_suffix(".new").write_text(str(version))
    weights.with_suffix(".new").replace(weights)
"""


def doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / "docs" / "sdk.md").read_text(), re.S)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedController]:
    server = ServedController(tmp_path, TOKEN, batch_size=8).launched("0001")
    yield server
    server.close()


def test_the_worker_and_trainer_blocks_of_the_sdk_page_run_as_written(served: ServedController, tmp_path: Path) -> None:
    worker_block, trainer_block = doc_blocks()
    (tmp_path / "worker.py").write_text(WORKER_PRELUDE + worker_block)
    (tmp_path / "trainer.py").write_text(TRAINER_PRELUDE.format(steps=STEPS) + trainer_block)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURM_ELASTIC_"))}
    env.update(PYTHONPATH=str(REPO), SLURM_ELASTIC_CONTROLLER_URL=served.url, SLURM_ELASTIC_TOKEN=TOKEN,
               SLURM_ELASTIC_WORKER_ID="0001", DOC_WEIGHTS=str(tmp_path / "weights"), DOC_MADE=str(tmp_path / "made"))
    workers = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py")], env={**env, "SLURM_PROCID": str(rank)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        trainer = subprocess.run([sys.executable, str(tmp_path / "trainer.py")], env=env, capture_output=True,
                                 text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        trainer = subprocess.CompletedProcess(exc.cmd, -9, exc.stdout or "", exc.stderr or "")
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGUSR1)  # the drain: each finishes its rollout, submits it, leaves
        logs = [worker.communicate(timeout=30)[0] for worker in workers]
    assert trainer.returncode == 0, (trainer.stdout, trainer.stderr, served.queue.stats(), logs)
    assert trainer.stdout.count("trained on 2 groups") == STEPS, trainer.stdout
    assert [worker.returncode for worker in workers] == [0, 0], logs
    made = len((tmp_path / "made").read_text().splitlines())
    with sqlite3.connect(tmp_path / "q.sqlite") as db:
        stored = db.execute("select count(*) from groups").fetchone()[0]
    refused_stale = served.queue.stats()["refused_stale_sequences"] // 4
    # made with weights saved before their version was published (the trainer saves, then publishes):
    # refused as ahead of the trainer's version, and logged
    refused_ahead = sum(log.count(" is ahead ") for log in logs)
    assert stored + refused_stale + refused_ahead == made and stored >= 2 * STEPS, (
        stored, refused_stale, refused_ahead, made, logs)
    assert not any("not stored: a group of this id was stored before" in log for log in logs), logs
    assert textwrap.dedent(worker_block) == worker_block  # the block is a whole module, as pasted
