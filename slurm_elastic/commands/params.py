"""Argument types shared by the commands (kept out of their modules so that a command imports
no other command's dependencies)."""

from __future__ import annotations

import math
from typing import Any

import click


class Seconds(click.ParamType[float]):
    """A finite number of seconds, at least ``min_s`` (``nan``, ``inf`` and negatives refused)."""

    name = "seconds"

    def __init__(self, min_s: float) -> None:
        self.min_s = min_s

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds) or seconds < self.min_s:
            self.fail(f"{value!r} is not a finite number of seconds of at least {self.min_s:g}", param, ctx)
        return seconds
