"""The rollout queue's settings (the job config's ``[queue]`` table), checked when the job starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slurm_elastic.errors import ConfigError, unknown_key


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
