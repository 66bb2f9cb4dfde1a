"""GPU telemetry adapters: NVML, the fault-injection source, and the per-node agent."""
