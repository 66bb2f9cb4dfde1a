"""The settings a worker step reads from its environment (see :class:`slurm_elastic.worker.context.StepContext`)."""

from __future__ import annotations

from slurm_elastic.controller.config_sections import WorkersSection


def worker_settings_env(w: WorkersSection) -> dict[str, str]:
    """Heartbeat, drain, readiness and liveness settings of ``[workers]`` as the wrapper's environment."""
    return {
        "SLURM_ELASTIC_HEARTBEAT_INTERVAL_S": str(w.heartbeat_interval_s),
        "SLURM_ELASTIC_DRAIN_SIGNAL": w.drain_signal,
        "SLURM_ELASTIC_WORKER_KIND": w.kind,
        "SLURM_ELASTIC_READINESS_PATH": w.readiness_path,
        "SLURM_ELASTIC_START_TIMEOUT_S": str(w.start_timeout_s),
        "SLURM_ELASTIC_LIVENESS_PATH": w.liveness_path or w.readiness_path,
        "SLURM_ELASTIC_LIVENESS_INTERVAL_S": str(w.liveness_interval_s),
        "SLURM_ELASTIC_LIVENESS_TIMEOUT_S": str(w.liveness_timeout_s),
        "SLURM_ELASTIC_LIVENESS_FAILURE_THRESHOLD": str(w.liveness_failure_threshold),
    }
