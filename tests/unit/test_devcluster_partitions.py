"""The dev cluster's partitions: the default one is never preempted; the scavenger one is, with a grace time."""

from __future__ import annotations

import re

import jinja2

from slurm_elastic.devcluster.cluster import DevClusterSpec
from slurm_elastic.resources import templates_dir


def _partitions(text: str) -> dict[str, dict[str, str]]:
    found = {}
    for line in text.splitlines():
        if line.startswith("PartitionName="):
            fields = dict(f.split("=", 1) for f in line.split())
            found[fields["PartitionName"]] = fields
    return found


def test_scavenger_jobs_are_preempted_by_both_others_and_the_default_partition_never() -> None:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir() / "devcluster")),
                             undefined=jinja2.StrictUndefined)
    spec = DevClusterSpec()
    text = env.get_template("slurm.conf.j2").render(**{**spec.to_json(), "nodes": []},
                                                    cgroup_plugin="cgroup/v1", slurm_version=[22, 5])
    assert re.search(r"^PreemptType=preempt/partition_prio$", text, re.MULTILINE)
    parts = _partitions(text)
    default, scavenger, urgent = parts[spec.partition], parts[spec.preempt_partition], parts[spec.urgent_partition]
    assert default["Default"] == "YES" and default["PreemptMode"] == "OFF" and urgent["PreemptMode"] == "OFF"
    assert scavenger["PreemptMode"] == "CANCEL" and scavenger["GraceTime"] == str(spec.preempt_grace_s)
    assert int(scavenger["PriorityTier"]) < int(default["PriorityTier"]) < int(urgent["PriorityTier"])
