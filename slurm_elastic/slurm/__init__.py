"""The Slurm adapter: one place runs commands, pure parsers, a CLI backend and an optional pyslurm one."""
