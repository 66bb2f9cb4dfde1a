"""The defaults of settings that several layers read -- the config schema, the core's
dataclasses, the worker's environment, the simulator's traces, command-line options -- each
written once, here."""

from __future__ import annotations

TICK_INTERVAL_S = 2.0  # between two controller ticks
ALLOCATION_CHECK_S = 30.0  # between two reads of the job's nodes (a failed node leaves a --no-kill job)
SLURM_TIMEOUT_S = 30.0  # one Slurm command the controller runs (squeue, sinfo, scontrol, scancel, sbatch)
HEARTBEAT_INTERVAL_S = 5.0  # between two heartbeats of a worker
HEARTBEAT_GRACE_S = 60.0  # a worker silent this long is killed and replaced
MAX_HEARTBEATS_PER_S = 20.0  # a larger pool beats more slowly (core/heartbeat_pace.py)
LONGEST_HEARTBEAT_INTERVAL_S = 3600.0  # the longest a controller tells, and a worker takes from an answer
START_TIMEOUT_S = 120.0  # launch to registration, else the launch failed
DRAIN_TIMEOUT_S = 120.0  # a draining worker is cancelled after this
STEP_END_SETTLE_S = 3.0  # a step gone from the listing without an exit waits this long for Slurm's word on why
BACKOFF_BASE_S = 5.0  # the first crash-loop backoff; doubles per crash
BACKOFF_MAX_S = 300.0  # the longest crash-loop backoff
SERVER_DRAIN_GRACE_S = 1.0  # servers: out of discovery at least this long before the drain signal
LIVENESS_INTERVAL_S = 5.0  # servers: between two liveness probes
LIVENESS_TIMEOUT_S = 5.0  # servers: a probe not answered within this fails
AGENT_INTERVAL_S = 5.0  # between two GPU samples of a health agent
AGENT_MAX_BACKOFF_S = 60.0  # a health agent's longest wait after failed reports
WEIGHTS_MAX_FAILURES = 3  # failed weight updates in a row that drain a server
WEIGHTS_TIMEOUT_S = 300.0  # one weight update's limit (a reload of a large model takes minutes)
WEIGHTS_RETRY_BACKOFF_S = 5.0  # before retrying a failed weight update; doubles per failure
