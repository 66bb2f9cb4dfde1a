"""The host's cgroups as the dev cluster's slurmd needs them: which Slurm cgroup plugin fits, and
on a cgroup v2 host without systemd, the slice slurmd puts its steps' cgroups under."""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
STEPD_SLICE = "system.slice"
SLURM_CONTROLLERS = ("cpuset", "cpu", "io", "memory", "pids")


def detect_cgroup_plugin(mounts: Path = Path("/proc/mounts")) -> str:
    """``cgroup/v1`` where the v1 devices controller is mounted, else ``cgroup/v2``."""
    try:
        with open(mounts) as lines:
            for line in lines:
                fields = line.split()
                if len(fields) > 3 and fields[2] == "cgroup" and "devices" in fields[3].split(","):
                    return "cgroup/v1"
    except OSError:
        pass
    return "cgroup/v2"


def ensure_stepd_slice(root: Path = CGROUP_ROOT) -> str | None:
    """Make ``system.slice`` where it is missing, with Slurm's controllers enabled; say what was done.

    With ``IgnoreSystemd=yes`` slurmd (cgroup/v2) creates its steps' scope in ``system.slice`` and
    fails to start where that does not exist, as on a host whose init is not systemd (a container,
    a small VM). Where systemd runs, the slice is there and nothing is changed.
    """
    slice_dir = root / STEPD_SLICE
    if slice_dir.is_dir() or not (root / "cgroup.controllers").is_file():
        return None
    available = (root / "cgroup.controllers").read_text().split()
    enable = " ".join(f"+{name}" for name in SLURM_CONTROLLERS if name in available)
    (root / "cgroup.subtree_control").write_text(enable)
    slice_dir.mkdir()
    (slice_dir / "cgroup.subtree_control").write_text(enable)
    return f"made {slice_dir} (no systemd here) with {enable or 'no controllers'}"
