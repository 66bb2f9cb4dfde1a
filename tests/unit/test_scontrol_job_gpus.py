"""The GPU indexes of one job per node, from ``scontrol show job -d`` as Slurm 22.05 prints it
(recorded on the dev cluster by data/record_scontrol_job.sh)."""

from __future__ import annotations

from slurm_elastic.slurm.parse import parse_scontrol_job_gpus


def test_nodes_with_the_same_layout_share_a_line_and_typed_gpus_and_gpuless_nodes_parse() -> None:
    text = ("JobId=7 JobName=x\n   NodeList=gpu[01-02],cpu1\n"
            "     Nodes=gpu[01-02] CPU_IDs=0-7 Mem=1000 GRES=gpu:a100:2(IDX:0,3)\n"
            "     Nodes=cpu1 CPU_IDs=0 Mem=100 GRES=\n")
    assert parse_scontrol_job_gpus(text) == {"gpu01": (0, 3), "gpu02": (0, 3), "cpu1": ()}
