"""The rollout buffer between workers and the trainer: durable, bounded, staleness-aware."""
