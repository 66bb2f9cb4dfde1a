"""The one place that runs external commands.

Every Slurm command goes through :func:`run_command` (blocking, with a timeout) or
:func:`spawn_detached` (a long-lived ``srun`` in its own session). Both log argv and convert
failures into :class:`~slurm_elastic.errors.SlurmCommandError`. Calls are counted per program,
so tests and benchmarks can check that a tick makes one batched ``squeue`` call.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from slurm_elastic.core.defaults import SLURM_TIMEOUT_S
from slurm_elastic.errors import SlurmCommandError, SlurmNotInstalledError, SlurmTimeoutError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = SLURM_TIMEOUT_S
_timeout_s = DEFAULT_TIMEOUT_S  # what run_command waits when not told: the controller sets controller.slurm_timeout_s

_APT_PACKAGE_OF = {
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "srun": "slurm-client",
    "sbatch": "slurm-client",
    "squeue": "slurm-client",
    "scancel": "slurm-client",
    "scontrol": "slurm-client",
    "sinfo": "slurm-client",
    "sdiag": "slurm-client",
}

_counts: collections.Counter[str] = collections.Counter()
_counts_lock = threading.Lock()


@dataclass(frozen=True)
class CommandResult:
    """What a finished command printed."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


def command_counts() -> dict[str, int]:
    """How many times each program was run by this process (a copy)."""
    with _counts_lock:
        return dict(_counts)


def _count(program: str) -> None:
    with _counts_lock:
        _counts[Path(program).name] += 1


def set_command_timeout(timeout_s: float) -> None:
    """The timeout of every command run without an explicit one, from now on (this process)."""
    global _timeout_s
    if not timeout_s > 0:
        raise ValueError(f"a command timeout must be > 0 s, not {timeout_s!r}")
    _timeout_s = float(timeout_s)


def command_timeout_s() -> float:
    """The timeout a command gets when its caller names none."""
    return _timeout_s


def require_binary(name: str) -> str:
    """The full path of ``name``, or an error that says which Debian package provides it."""
    path = shutil.which(name)
    if path is None:
        package = _APT_PACKAGE_OF.get(name, "slurm-client")
        raise SlurmNotInstalledError(
            f"{name!r} is not on PATH: install Slurm (Debian/Ubuntu: apt-get install {package}), "
            "or put your cluster's Slurm binaries on PATH"
        )
    return path


def run_command(
    argv: Sequence[str],
    *,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> CommandResult:
    """Run ``argv`` to completion; raise on a non-zero exit (if ``check``), a timeout (``timeout_s``,
    else :func:`command_timeout_s`), or a missing binary."""
    argv = list(argv)
    timeout_s = _timeout_s if timeout_s is None else timeout_s
    require_binary(argv[0])
    _count(argv[0])
    log.debug("run: %s", " ".join(argv))
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise SlurmTimeoutError(
            argv, None, _text(exc.stdout), _text(exc.stderr), reason=f"timed out after {timeout_s:g} s"
        ) from None
    except OSError as exc:
        raise SlurmCommandError(argv, None, "", str(exc), reason=str(exc)) from None
    result = CommandResult(tuple(argv), proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        raise SlurmCommandError(argv, proc.returncode, proc.stdout, proc.stderr)
    return result


def spawn_detached(
    argv: Sequence[str],
    *,
    log_path: Path,
    env: Mapping[str, str] | None = None,
) -> int:
    """Start ``argv`` in a new session (immune to the caller's death and process-group signals).

    Its stdout and stderr go to ``log_path``, after a line that marks the start (``SPAWNED``);
    stdin is /dev/null. Returns the pid. One shared daemon thread reaps every child (not a thread
    per child: a controller keeps one srun per worker), so none lingers as a zombie while the caller
    lives (woken by the child's end; at most ``REAP_INTERVAL_S`` without pidfds); a child killed by
    a signal gets a line saying so
    (``KILLED_BY_SIGNAL``) at the end of its log.
    """
    argv = list(argv)
    require_binary(argv[0])
    _count(argv[0])
    log.debug("spawn: %s", " ".join(argv))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        out.write(f"{SPAWNED} {os.path.basename(argv[0])}\n".encode())
        out.flush()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            raise SlurmCommandError(argv, None, "", str(exc), reason=str(exc)) from None
    _reaper.adopt(proc, log_path)
    return proc.pid


REAP_INTERVAL_S = 0.5  # how often children are polled where pidfds are missing
PIDFDS_MAX = 512  # pidfds the reaper holds at most (descriptors: controller/open_files.py reserves them)
SPAWNED = "slurm-elastic: spawned"
KILLED_BY_SIGNAL = "was killed by signal"


def killed_since_spawned(log_path: Path, tail_bytes: int = 65536) -> str | None:
    """The line that says the last child spawned with ``log_path`` was killed by a signal; None
    if it was not (or not while its spawner lived to reap it)."""
    try:
        with log_path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    since = next((lines[i + 1:] for i in range(len(lines) - 1, -1, -1) if lines[i].startswith(SPAWNED)), [])
    return next((line for line in since if line.startswith("slurm-elastic: ") and KILLED_BY_SIGNAL in line), None)


class _Reaper:
    """Waits for detached children without a thread each: one thread sleeps in ``poll()`` on a
    pidfd per child, which turns readable the moment the child ends, so it takes no CPU while they
    run (polling 256 children every half second was 0.3 % of a core). At most ``PIDFDS_MAX`` are
    held (the controller reserves descriptors for them); a child without one (more children, or a
    kernel before 5.3) is polled every ``REAP_INTERVAL_S``."""

    def __init__(self) -> None:
        self._children: dict[subprocess.Popen[bytes], tuple[Path, int | None]] = {}  # -> log, pidfd
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None  # a pipe: a new child wakes the thread to watch it too

    def adopt(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        with self._lock:
            pidfd = _pidfd(proc.pid) if sum(fd is not None for _p, fd in self._children.values()) < PIDFDS_MAX else None
            self._children[proc] = (log_path, pidfd)
            if self._wake is None:
                self._wake = os.pipe()
                os.set_blocking(self._wake[0], False)
                os.set_blocking(self._wake[1], False)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, args=(self._wake[0],), name="reap-detached",
                                                daemon=True)
                self._thread.start()
            with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
                os.write(self._wake[1], b"\0")

    def pending(self) -> int:
        with self._lock:
            return len(self._children)

    def _run(self, wake_fd: int) -> None:
        while True:
            try:
                self._wait(wake_fd)
                ended = self._take_ended()
            except Exception:  # a reaper that stops leaves zombies: log it and go on
                log.exception("reaping detached children")
                time.sleep(REAP_INTERVAL_S)
                continue
            for proc, path in ended:
                if proc.returncode < 0:
                    _note_killed(proc, path)

    def _wait(self, wake_fd: int) -> None:
        """Until a watched child ends, a child is adopted, or REAP_INTERVAL_S if some are unwatched."""
        poller = select.poll()
        poller.register(wake_fd, select.POLLIN)
        with self._lock:
            for _path, pidfd in self._children.values():
                if pidfd is not None:
                    poller.register(pidfd, select.POLLIN)
            unwatched = any(pidfd is None for _path, pidfd in self._children.values())
        poller.poll(1000 * REAP_INTERVAL_S if unwatched else None)
        with contextlib.suppress(BlockingIOError):
            while os.read(wake_fd, 512):
                pass

    def _take_ended(self) -> list[tuple[subprocess.Popen[bytes], Path]]:
        """The children that ended, reaped and forgotten (their pidfds closed). A child is reaped
        through its pidfd where it has one (never another process that took its pid)."""
        ended = []
        with self._lock:
            for proc, (path, pidfd) in list(self._children.items()):
                if (proc.poll() if pidfd is None else _reaped(proc, pidfd)) is None:
                    continue
                del self._children[proc]
                if pidfd is not None:
                    with contextlib.suppress(OSError):
                        os.close(pidfd)
                ended.append((proc, path))
        return ended


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)  # a child that ended already: readable at once
    except (AttributeError, OSError):
        return None


def _reaped(proc: subprocess.Popen[bytes], pidfd: int) -> int | None:
    """``proc``'s exit code (it is reaped) once it has ended, else None; reaped through ``pidfd``."""
    try:
        result = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
    except (AttributeError, OSError):  # reaped elsewhere (ECHILD), or a kernel without P_PIDFD: what Popen knows
        return proc.poll()
    if result is None:
        return None
    proc.returncode = result.si_status if result.si_code == os.CLD_EXITED else -result.si_status
    return proc.returncode


def _note_killed(proc: subprocess.Popen[bytes], log_path: Path) -> None:
    """Append to the child's log that a signal killed it (not the command it ran: srun, say)."""
    number = -proc.returncode
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = "unknown"
    program = os.path.basename(str(proc.args[0])) if isinstance(proc.args, list) and proc.args else "child"
    line = f"slurm-elastic: {program} (pid {proc.pid}) {KILLED_BY_SIGNAL} {number} ({name})"
    log.warning("%s; its log: %s", line.removeprefix("slurm-elastic: "), log_path)
    try:
        with open(log_path, "ab") as out:
            out.write(f"{line}\n".encode())
    except OSError:
        pass


_reaper = _Reaper()


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except PermissionError:
        return os.path.exists(f"/proc/{pid}")
