"""``python -m slurm_elastic`` is the ``slurm-elastic`` command."""

from slurm_elastic.cli import main

main()
