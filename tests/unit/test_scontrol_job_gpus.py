"""The GPU indexes of one job per node, from ``scontrol show job -d`` as Slurm 22.05 prints it
(recorded on the dev cluster by data/record_scontrol_job.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.slurm.parse import parse_scontrol_job_gpus

DATA = Path(__file__).with_name("data")


@pytest.mark.parametrize(("recording", "gpus"), [
    ("scontrol_job_one_node_22.05.txt", {"node1": (0,)}),
    ("scontrol_job_two_nodes_22.05.txt", {"node1": (1, 2), "node2": (0, 1)}),
    ("scontrol_job_pending_22.05.txt", {}),
])
def test_gpu_indexes_per_node_from_a_recorded_job(recording: str, gpus: dict[str, tuple[int, ...]]) -> None:
    assert parse_scontrol_job_gpus((DATA / recording).read_text()) == gpus


def test_nodes_with_the_same_layout_share_a_line_and_typed_gpus_and_gpuless_nodes_parse() -> None:
    text = ("JobId=7 JobName=x\n   NodeList=gpu[01-02],cpu1\n"
            "     Nodes=gpu[01-02] CPU_IDs=0-7 Mem=1000 GRES=gpu:a100:2(IDX:0,3)\n"
            "     Nodes=cpu1 CPU_IDs=0 Mem=100 GRES=\n")
    assert parse_scontrol_job_gpus(text) == {"gpu01": (0, 3), "gpu02": (0, 3), "cpu1": ()}
