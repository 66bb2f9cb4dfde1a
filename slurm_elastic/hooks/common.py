"""What both hooks share: their config file, their log, the node-local state directory."""

from __future__ import annotations

import difflib
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from slurm_elastic.core.limits import MAX_GPUS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_FILE = Path(os.environ.get("SLURM_ELASTIC_HOOKS_CONFIG", "/etc/slurm-elastic/hooks.toml"))
STRICT_BAD_GPU_EXIT = 3  # the prolog's "drain this node" code; the sbin wrapper turns it into 1


@dataclass(frozen=True)
class HookConfig:
    node_state_dir: Path = Path("/var/lib/slurm-elastic")
    log_file: Path = Path("/var/log/slurm-elastic/hooks.log")
    strict: bool = False
    source: str = "auto"
    inject_file: str = ""
    gpus: int = 0
    kill_wait_s: float = 3.0
    slurm_bin_dir: str = ""  # where squeue and scancel are, where not on slurmd's PATH (/bin:/usr/bin)


_KINDS = {int: "a whole number", float: "a number"}  # what a value must be, by its default's type; else a string (paths too)
_CHOICES = {"source": ("auto", "nvml", "inject")}  # keys that take one of a few words
# the largest number of each key, and why: the epilog waits kill_wait_s while the node stays COMPLETING
_LARGEST = {"gpus": (MAX_GPUS, "GPUs of one node"), "kill_wait_s": (3600.0, "the node stays COMPLETING while the "
                                                                            "epilog waits")}


def _of_its_kind(value: object, default: object) -> bool:
    """Whether a TOML value is of the key's kind: TOML is typed, so ``gpus = 2.7`` or ``"4"`` and
    ``inject_file = 5`` are mistakes, not values to convert."""
    if isinstance(value, bool) or isinstance(default, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, int | float):
        return isinstance(value, int) if isinstance(default, int) else isinstance(value, int | float)
    return isinstance(value, str)


def load_hook_config(path: Path = CONFIG_FILE, problems: list[str] | None = None) -> HookConfig:
    """The optional config file; unknown keys are ignored (told as a problem, with the key it resembles). A file that cannot be
    read and a bad value raise ValueError, or, with ``problems`` given, are told there and leave
    their keys at the defaults (a hook still does its work: the epilog's clean-up, the prolog's check)."""
    def refuse(message: str) -> None:
        if problems is None:
            raise ValueError(message)
        problems.append(message)

    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        data = {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        refuse(f"hooks config {path} cannot be read ({exc}): every key at its default")
        data = {}
    defaults = HookConfig()
    known = HookConfig.__dataclass_fields__
    values = {}
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            message = f"hooks config {path}: unknown key {key!r} ignored" + (f" (did you mean {close[0]!r}?)" if close else "")
            if problems is None:
                logging.getLogger(__name__).warning(message)
            else:  # told in the hooks' own log, as a bad value is (a misspelt `strict` would go unseen)
                problems.append(message)
            continue
        default = getattr(defaults, key)
        if isinstance(default, bool) and not isinstance(value, bool):  # bool("false") is True
            refuse(f"hooks config {path}: {key} must be true or false, not {value!r}")
            continue
        try:
            if not _of_its_kind(value, default):
                raise TypeError(key)
            converted = type(default)(value)
        except (TypeError, ValueError):
            refuse(f"hooks config {path}: {key} must be {_KINDS.get(type(default), 'a string')}, not {value!r}")
            continue
        if isinstance(default, int | float) and not isinstance(default, bool) and not 0 <= converted < math.inf:
            refuse(f"hooks config {path}: {key} must be a finite number >= 0, not {value!r}")
            continue
        if isinstance(value, str) and "\x00" in value:
            refuse(f"hooks config {path}: {key} holds a NUL character (\\x00), which no path can hold")
            continue
        if key in _LARGEST and converted > _LARGEST[key][0]:
            refuse(f"hooks config {path}: {key} must be at most {_LARGEST[key][0]:g} ({_LARGEST[key][1]}), not {value!r}")
            continue
        if key in _CHOICES and converted not in _CHOICES[key]:
            refuse(f"hooks config {path}: {key} must be one of {', '.join(_CHOICES[key])}, not {value!r}")
            continue
        values[key] = converted
    return HookConfig(**values)


def setup_logging(config: HookConfig, hook: str) -> logging.Logger:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    try:
        config.log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(config.log_file))
    except OSError:
        pass
    job = os.environ.get("SLURM_JOB_ID", "?")
    node = os.environ.get("SLURMD_NODENAME", "?")
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True,
                        format=f"%(asctime)s {hook} job={job} node={node} %(levelname)s %(message)s")
    return logging.getLogger(hook)


def job_dir(config: HookConfig, job_id: str) -> Path:
    return config.node_state_dir / job_id
