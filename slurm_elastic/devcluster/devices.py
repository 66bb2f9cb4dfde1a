"""GPU device files for the dev cluster: fake ones (distinct character devices whose driver is
live on this host), or the host's real NVIDIA GPUs.

Slurm's device cgroup (``ConstrainDevices=yes``) allows or denies by (major, minor). A fake
GPU must therefore (1) be a character device whose open() works here, so "can open" is a real
test, and (2) have a (major, minor) that no ordinary program needs: a step that is denied the
device must still run. /dev/null, /dev/zero or /dev/urandom are bad choices (a step denied
/dev/null cannot even start: slurmstepd itself opens it). We take rarely used live devices.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from slurm_elastic.errors import DevClusterError

# In order of preference; each is probed (stat + open) on this host before use.
CANDIDATE_DEVICES: tuple[str, ...] = (
    "/dev/full",
    "/dev/kmsg",
    "/dev/loop-control",
    "/dev/fuse",
    "/dev/net/tun",
    "/dev/autofs",
    "/dev/btrfs-control",
    "/dev/userfaultfd",
    "/dev/vga_arbiter",
    "/dev/vsock",
    "/dev/vhost-vsock",
    "/dev/vhost-net",
    "/dev/uinput",
    "/dev/mapper/control",
    "/dev/snapshot",
)


@dataclass(frozen=True)
class CharDevice:
    """A live character device: where it is and its (major, minor)."""

    source: str
    major: int
    minor: int


def can_open(path: str | Path) -> bool:
    """True if ``path`` opens read-only here (no blocking, no controlling terminal)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return False
    os.close(fd)
    return True


def live_char_devices(candidates: tuple[str, ...] = CANDIDATE_DEVICES) -> list[CharDevice]:
    """The candidates that exist as character devices and open, with distinct (major, minor)."""
    found: list[CharDevice] = []
    seen: set[tuple[int, int]] = set()
    for path in candidates:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if not stat.S_ISCHR(st.st_mode):
            continue
        key = (os.major(st.st_rdev), os.minor(st.st_rdev))
        if key in seen or not can_open(path):
            continue
        seen.add(key)
        found.append(CharDevice(path, *key))
    return found


NVIDIA_GPU_DEVICE = re.compile(r"nvidia(\d+)")


def nvidia_gpu_devices(dev_dir: Path = Path("/dev")) -> list[Path]:
    """The host's NVIDIA GPU device files (``/dev/nvidia0``, ``/dev/nvidia1``, ...) in their number's order.

    The driver numbers them in probe order, usually PCI bus order, which is NVML's: a node whose
    gres.conf lists them so gets Slurm GPU indexes equal to NVML's.
    """
    found = []
    for path in dev_dir.glob("nvidia*"):
        match = NVIDIA_GPU_DEVICE.fullmatch(path.name)
        if match and path.is_char_device():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def make_fake_gpus(dev_dir: Path, node: str, count: int, pool: list[CharDevice]) -> list[Path]:
    """Create ``count`` fake GPU device files for ``node`` under ``dev_dir/node/``, distinct within the node.

    Nodes are separate machines in a real cluster, so different nodes may reuse the same
    (major, minor); within one node every GPU gets its own.
    """
    if count > len(pool):
        raise DevClusterError(
            f"{count} fake GPUs per node asked for, but only {len(pool)} distinct live character "
            f"devices were found on this host ({', '.join(d.source for d in pool) or 'none'}); "
            "use fewer --gpus-per-node"
        )
    node_dir = dev_dir / node
    node_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, device in enumerate(pool[:count]):
        path = node_dir / f"gpu{index}"
        wanted = os.makedev(device.major, device.minor)
        try:
            st = os.stat(path)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == wanted:
                paths.append(path)
                continue
            path.unlink()
        except FileNotFoundError:
            pass
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, wanted)
        except PermissionError:
            raise DevClusterError("creating fake GPU device files needs root (mknod)") from None
        paths.append(path)
    return paths
