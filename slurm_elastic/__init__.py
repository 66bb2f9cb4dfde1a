"""slurm-elastic: elastic RL rollout workers as GPU-pinned Slurm job steps."""

__version__ = "0.1.0"
