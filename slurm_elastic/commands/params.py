"""Argument types shared by the commands (kept out of their modules so that a command imports
no other command's dependencies). Every number is taken in ASCII digits only: Python's ``int()``
and ``float()`` also read other scripts' digits (Arabic-Indic, fullwidth), ``_`` and spaces."""

from __future__ import annotations

import math
import re
from typing import Any

import click

from slurm_elastic.core.health import parse_gpu_ref
from slurm_elastic.core.limits import MAX_DURATION_S, MAX_JOB_ID, shown

NODE_NAME = re.compile(r"[A-Za-z0-9._-]+")


class Whole(click.IntRange):
    """A whole number in ASCII digits (a sign allowed, for the range to judge), within the range."""

    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not re.fullmatch(r"[-+]?[0-9]+", value):
            self.fail(f"{value!r} is not a whole number in ASCII digits (0-9)", param, ctx)
        return super().convert(value, param, ctx)

    def _describe_range(self) -> str:
        """Nothing for an unbounded one (click's says ``x<=None`` in the help)."""
        if self.min is None and self.max is None:
            return ""
        return super()._describe_range()


JOB_ID = Whole(min=1, max=MAX_JOB_ID)  # a Slurm job id (32-bit)


class Seconds(click.ParamType[float]):
    """A finite number of seconds from ``min_s`` to ``max_s`` (``nan``, ``inf`` and negatives refused;
    by default at most a year, past which a wait never ends within a job and ``time.sleep`` and
    thread waits overflow)."""

    name = "seconds"

    def __init__(self, min_s: float, max_s: float = MAX_DURATION_S) -> None:
        self.min_s, self.max_s = min_s, max_s

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, str) and not re.fullmatch(r"[-+.0-9eE]+|[-+]?(?i:nan|inf|infinity)", value):
            self.fail(f"{value!r} is not a number of seconds in ASCII digits (e.g. 30 or 2.5)", param, ctx)
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds) or seconds < self.min_s:
            self.fail(f"{value!r} is not a finite number of seconds of at least {self.min_s:g}", param, ctx)
        if seconds > self.max_s:
            self.fail(f"{value!r} is above the largest, {shown(self.max_s)} s (a year)", param, ctx)
        return seconds


class GpuRef(click.ParamType[tuple[str, int]]):
    """``NODE:GPU``: one node's name and a GPU index in ASCII digits."""

    name = "NODE:GPU"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, int]:
        if isinstance(value, tuple):
            return value
        try:
            node, gpu = parse_gpu_ref(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        if not NODE_NAME.fullmatch(node):
            self.fail(f"{node!r} is not one node's name (one GPU at a time, e.g. node1:2; no ranges)", param, ctx)
        return node, gpu
