"""The largest values the edges take (config files, traces, command-line options), each with the
reason it is the largest. Past them a value means nothing to the code that reads it (a timer that
never fires, a count no cluster has) or breaks it (``time.sleep(1e300)`` and thread waits raise
``OverflowError``; SQLite holds integers below 2^63). Each bound is well past any real setting,
so a real configuration never meets one."""

from __future__ import annotations

# Durations: a year. No Slurm job runs that long, so a longer timer never fires within its run,
# and every timer stays far below what the OS's waits take (time_t, threading.TIMEOUT_MAX).
MAX_DURATION_S = 366 * 86400.0
# GPUs on one node (or in one step, one burst job): the largest nodes hold 8-16; 1024 leaves room.
MAX_GPUS = 1024
# CPUs of a node or a step: Slurm counts them in 16 bits.
MAX_CPUS = 65535
# Memory in MB (of a node, a step, a GPU): 2^30 MB is a pebibyte, past any node.
MAX_MEM_MB = 2**30
# Nodes of a job: past the largest clusters (about 10,000 nodes).
MAX_NODES = 65536
# Workers of one job (autoscaler.min_workers, max_workers; the steps of one job): Slurm's
# MaxStepCount defaults to 40,000 steps per job, and every worker is one.
MAX_WORKERS = 40_000
# Sequences and groups the queue counts (capacity, admissions, hand-out look-ahead): 2^31, far past
# what one buffer of rollouts holds, and far below SQLite's 2^63.
MAX_SEQS = 2**31
# Bytes of the queue on disk (a tebibyte) and of one group (a gibibyte: one HTTP body, parsed in
# the controller's memory).
MAX_QUEUE_BYTES = 2**40
MAX_GROUP_BYTES = 2**30
# Policy versions a rollout may lag (AReaL's bound): AReaL's own settings are 1 to 8; at 1000 a
# rollout is from a policy a thousand updates old and the bound no longer bounds anything.
MAX_STALENESS = 1000
# Counts of repetitions (failed probes, crashes, confirmations, failed updates in a row).
MAX_REPEATS = 1000
# A Slurm job id: Slurm's ids are 32-bit.
MAX_JOB_ID = 2**32 - 1
# A job's --time in minutes (job.time_limit, burst.time_limit): the largest Slurm 22.05 keeps as
# given, 24855-03:13:00 (68 years: its seconds fit 31 bits). sbatch takes larger ones without a word
# and Slurm wraps them: 35791394 minutes showed as 2957761 days, 10^8 as 19734 days, 2^31 to 2^32
# as UNLIMITED, and 4294967297 as one minute (measured with scontrol show job).
MAX_TIME_LIMIT_MIN = 35_791_393


def shown(value: float) -> str:
    """A number as an error message writes it: whole ones in digits (31622400, not 3.16224e+07)."""
    if isinstance(value, int) or (abs(value) < 1e15 and float(value).is_integer()):
        return str(int(value))
    return f"{value:g}"
