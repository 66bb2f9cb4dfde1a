"""Where the shipped templates and admin hooks live, in a wheel or in a checkout."""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    installed = _PACKAGE_DIR / "_data" / name
    if installed.is_dir():
        return installed
    checkout = _PACKAGE_DIR.parent / name
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"slurm-elastic data directory {name!r} not found near {_PACKAGE_DIR}")


def templates_dir() -> Path:
    """The jinja2 templates (sbatch script, dev cluster configs, hooks)."""
    return _data_dir("templates")


def sbin_dir() -> Path:
    """The admin hooks (prolog/epilog)."""
    return _data_dir("sbin")
