"""The rollout queue's settings (the job config's ``[queue]`` table), checked when the job starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slurm_elastic.core.limits import (
    MAX_DURATION_S,
    MAX_GROUP_BYTES,
    MAX_QUEUE_BYTES,
    MAX_SEQS,
    MAX_STALENESS,
    shown,
)
from slurm_elastic.errors import ConfigError, unknown_key

# The largest value of each count, and why (core/limits.py)
LARGEST: dict[str, tuple[int, str]] = {
    "batch_size": (MAX_SEQS, "2^31 sequences"),
    "capacity_seqs": (MAX_SEQS, "2^31 sequences"),
    "max_concurrent": (MAX_SEQS, "2^31 sequences"),
    "lookahead_groups": (MAX_SEQS, "2^31 groups"),
    "capacity_bytes": (MAX_QUEUE_BYTES, "a tebibyte on disk"),
    "max_group_bytes": (MAX_GROUP_BYTES, "a gibibyte: one group is one HTTP body, parsed in the controller's memory"),
    "max_staleness": (MAX_STALENESS, "AReaL's settings are 1 to 8: past a thousand versions the bound bounds nothing"),
    "admission_ttl_s": (int(MAX_DURATION_S), "a year: longer than any Slurm job runs"),
}


@dataclass(frozen=True)
class QueueConfig:
    batch_size: int = 32
    capacity_seqs: int = 4096
    capacity_bytes: int = 512 * 1024 * 1024
    max_staleness: int = 4
    max_concurrent: int = 1024
    max_group_bytes: int = 32 * 1024 * 1024
    admission_ttl_s: int = 600  # an admission not followed by a submit within this long is released
    fsync: str = "always"
    direct_io: bool = True  # with fsync always: the log written past the page cache (see segments.py)
    lookahead_groups: int = 64

    @classmethod
    def from_mapping(cls, data: dict[str, Any], prefix: str = "queue") -> QueueConfig:
        known = cls.__dataclass_fields__
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                raise ConfigError(f"{prefix}.{key}: {unknown_key(key, known)}")
            default = known[key].default
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ConfigError(f"{prefix}.{key}: true or false")
            elif isinstance(default, str):
                if value not in ("always", "os", "off"):
                    raise ConfigError(f"{prefix}.{key}: one of always, os, off")
            elif isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "max_staleness" else 1):
                least = "a whole number, 0 or more" if key == "max_staleness" else "a positive integer"
                raise ConfigError(f"{prefix}.{key}: must be {least}")
            elif value > LARGEST[key][0]:
                raise ConfigError(f"{prefix}.{key}: {shown(value)} is above its largest, {shown(LARGEST[key][0])} ({LARGEST[key][1]})")
            values[key] = value
        config = cls(**values)
        if config.capacity_seqs < config.batch_size:
            raise ConfigError(f"{prefix}.capacity_seqs ({config.capacity_seqs}) is below {prefix}.batch_size "
                              f"({config.batch_size}): the buffer could never hold a whole batch")
        if config.capacity_bytes < config.max_group_bytes:
            raise ConfigError(f"{prefix}.capacity_bytes ({config.capacity_bytes}) is below "
                              f"{prefix}.max_group_bytes ({config.max_group_bytes}): a group under the size "
                              "limit could never be accepted")
        return config
