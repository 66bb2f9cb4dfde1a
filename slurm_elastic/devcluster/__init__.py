"""A local multi-node Slurm cluster on one host, with fake GPUs, for development and tests."""

from slurm_elastic.devcluster.cluster import DevCluster, DevClusterSpec

__all__ = ["DevCluster", "DevClusterSpec"]
