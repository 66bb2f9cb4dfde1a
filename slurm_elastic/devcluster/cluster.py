"""Bring a local Slurm cluster up and down: one slurmctld and N ``slurmd -N nodeN`` on this host.

Everything (rendered configs, spool, state, logs, pid files, fake GPU device files) lives under
one directory. ``up`` is idempotent and waits until every node answers; ``down`` cancels the
cluster's jobs and stops exactly the daemons it started (by pid), with their children.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from slurm_elastic.devcluster.cgroups import detect_cgroup_plugin, ensure_stepd_slice
from slurm_elastic.devcluster.devices import live_char_devices, make_fake_gpus, nvidia_gpu_devices
from slurm_elastic.devcluster.spec import (
    SPEC_FILE,
    DevClusterSpec,
    default_dir,
    render_config_files,
    write_atomic,
)
from slurm_elastic.errors import DevClusterError, SlurmError
from slurm_elastic.slurm.backend import parse_slurm_version
from slurm_elastic.slurm.runner import require_binary, run_command

SBIN_PROGRAMS = frozenset({"slurmctld", "slurmd", "slurmstepd"})
READY_NODE_STATES = {"idle", "mix", "mixed", "alloc", "allocated", "comp", "completing"}
Progress = Callable[[str], None]
__all__ = ["DevCluster", "DevClusterSpec", "default_dir", "port_is_free"]


class DevCluster:
    """A dev cluster rooted at ``spec.dir``."""

    def __init__(self, spec: DevClusterSpec) -> None:
        self.spec = spec
        self.dir = spec.dir.resolve()

    @classmethod
    def at(cls, directory: Path) -> DevCluster:
        """The cluster whose files are in ``directory`` (as recorded by its last ``up``)."""
        spec_path = directory / SPEC_FILE
        if not spec_path.exists():
            raise DevClusterError(f"no dev cluster in {directory} (run `slurm-elastic devcluster up`)")
        try:
            spec = DevClusterSpec.from_json(json.loads(spec_path.read_text()))
        except (ValueError, TypeError) as exc:
            raise DevClusterError(f"{spec_path} is corrupt: {exc}") from None
        return cls(dataclasses.replace(spec, dir=directory))

    # ---- paths -------------------------------------------------------------------------------
    @property
    def conf_path(self) -> Path:
        return self.dir / "etc" / "slurm.conf"

    def binary(self, name: str) -> str:
        """The program ``name`` of this cluster's Slurm: from ``slurm_prefix`` if set, else PATH."""
        if not self.spec.slurm_prefix:
            return require_binary(name)
        prefix = Path(self.spec.slurm_prefix)
        path = prefix / ("sbin" if name in SBIN_PROGRAMS else "bin") / name
        if not os.access(path, os.X_OK):
            raise DevClusterError(f"{path} is missing: --slurm-prefix {prefix} is not a Slurm install "
                                  "(configure --prefix=DIR && make install puts one there)")
        return str(path)

    def slurm_version(self) -> tuple[int, int]:
        """(major, minor) of this cluster's Slurm, from ``slurmd -V`` (which needs no slurm.conf)."""
        text = run_command([self.binary("slurmd"), "-V"], timeout_s=10).stdout
        version = parse_slurm_version(text)
        if version is None:
            raise DevClusterError(f"cannot read the Slurm version from `slurmd -V`: {text.strip()!r}")
        return version

    def env(self) -> dict[str, str]:
        """Environment for Slurm clients talking to this cluster (its own Slurm first on PATH)."""
        env = {**os.environ, "SLURM_CONF": str(self.conf_path)}
        if self.spec.slurm_prefix:
            env["PATH"] = os.pathsep.join([self._prefix_bin(), env.get("PATH", "")])
        return env

    def env_lines(self) -> str:
        lines = f"export SLURM_CONF={self.conf_path}\n"
        if self.spec.slurm_prefix:
            lines += f'export PATH="{self._prefix_bin()}:$PATH"\n'
        return lines

    def _prefix_bin(self) -> str:
        return str(Path(self.spec.slurm_prefix).resolve() / "bin")

    def _pid_file(self, daemon: str) -> Path:
        return self.dir / "run" / f"{daemon}.pid"

    def _log_file(self, daemon: str) -> Path:
        return self.dir / "log" / f"{daemon}.log"

    def _daemons(self) -> list[str]:
        return ["slurmctld"] + [f"slurmd-{n}" for n in self.spec.node_names()]

    # ---- state -------------------------------------------------------------------------------
    def daemon_pid(self, daemon: str) -> int | None:
        """The pid of ``daemon`` if its pid file names a live process of that program."""
        try:
            pid = int(self._pid_file(daemon).read_text().strip())
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            program = daemon.split("-", 1)[0]
            cmdline = proc.cmdline()
            if not cmdline or Path(cmdline[0]).name != program:
                return None
            if program == "slurmd" and daemon.split("-", 1)[1] not in cmdline:
                return None
            return pid
        except (FileNotFoundError, ValueError, psutil.Error):
            return None

    def node_states(self) -> dict[str, str]:
        """Node name -> Slurm state as sinfo reports it (``idle``, ``down*``, ...)."""
        result = run_command([self.binary("sinfo"), "-h", "-N", "-o", "%N %t"], env=self.env(), timeout_s=10)
        states: dict[str, str] = {}
        for line in result.stdout.splitlines():
            name, _, state = line.strip().partition(" ")
            if name:
                states[name] = state.strip()
        return states

    def status(self) -> dict[str, object]:
        """Daemons with their pids and node states, for ``devcluster status``."""
        daemons = {d: self.daemon_pid(d) for d in self._daemons()}
        nodes: dict[str, str] = {}
        if daemons["slurmctld"]:
            try:
                nodes = self.node_states()
            except SlurmError as exc:
                nodes = {"error": str(exc)}
        return {"dir": str(self.dir), "slurm_conf": str(self.conf_path), "daemons": daemons, "nodes": nodes}

    def is_up(self) -> bool:
        if any(self.daemon_pid(d) is None for d in self._daemons()):
            return False
        try:
            states = self.node_states()
        except SlurmError:
            return False
        return all(states.get(n, "").rstrip("*") in READY_NODE_STATES and not states[n].endswith("*")
                   for n in self.spec.node_names())

    # ---- up ----------------------------------------------------------------------------------
    def up(self, *, wait_s: float = 60.0, progress: Progress = lambda _msg: None) -> None:
        """Start the cluster (or find it running) and wait until every node answers."""
        if os.geteuid() != 0:
            raise DevClusterError(
                "the dev cluster needs root (it runs slurmd, creates device files and cgroups): "
                "run it with sudo, or point slurm-elastic at an existing cluster instead"
            )
        for binary in ("slurmctld", "slurmd", "sinfo", "srun", "squeue", "scancel", "sbatch", "scontrol"):
            self.binary(binary)
        running = self._recorded_spec()
        if (running is not None and DevClusterSpec.from_json(running).to_json() != self.spec.to_json()
                and self.daemon_pid("slurmctld")):
            raise DevClusterError(
                f"a dev cluster with another shape is running in {self.dir}: "
                "run `slurm-elastic devcluster down` first"
            )
        if self.is_up():
            progress(f"dev cluster already up ({len(self.spec.node_names())} nodes)")
            if self._render_files()["slurm.conf"] != self.conf_path.read_text():
                progress("its slurm.conf differs from the template: `slurm-elastic devcluster reconfigure` applies it")
            return
        self._prepare_files(progress)
        self._check_ports_free()
        if self.daemon_pid("slurmctld") is None:
            progress("starting slurmctld")
            self._start([self.binary("slurmctld"), "-i"], "slurmctld")
        if detect_cgroup_plugin() == "cgroup/v2" and (made := ensure_stepd_slice()):
            progress(made)
        for node in self.spec.node_names():
            if self.daemon_pid(f"slurmd-{node}") is None:
                progress(f"starting slurmd -N {node}")
                self._start([self.binary("slurmd"), "-N", node], f"slurmd-{node}")
        self._wait_ready(wait_s, progress)

    def reconfigure(self, *, wait_s: float = 60.0, progress: Progress = lambda _msg: None) -> bool:
        """Write the configs from the templates again and, if slurm.conf changed, restart slurmctld
        (running jobs and steps keep running: it recovers them from its state directory) and have
        every slurmd re-read it. Returns whether anything changed."""
        if not self.is_up():
            raise DevClusterError("the dev cluster is not up: `slurm-elastic devcluster up` renders the templates")
        before = self.conf_path.read_text()
        self._prepare_files(progress)
        if self.conf_path.read_text() == before:
            progress("slurm.conf unchanged")
            return False
        pid = self.daemon_pid("slurmctld")
        if pid is not None:
            progress(f"restarting slurmctld (pid {pid})")
            with contextlib.suppress(psutil.NoSuchProcess):
                proc = psutil.Process(pid)
                proc.terminate()
                proc.wait(timeout=30)
        self._start([self.binary("slurmctld"), "-i"], "slurmctld")
        self._wait_ready(wait_s, progress)
        run_command([self.binary("scontrol"), "reconfigure"], env=self.env(), timeout_s=30)
        return True

    def _recorded_spec(self) -> dict[str, object] | None:
        try:
            data = json.loads((self.dir / SPEC_FILE).read_text())
            return data if isinstance(data, dict) else None
        except (OSError, ValueError):
            return None

    def _prepare_files(self, progress: Progress) -> None:
        for sub in ("etc", "state", "spool", "log", "run", "dev"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        pool = live_char_devices()
        real = self._real_gpus(progress)
        nodes = []
        for index, name in enumerate(self.spec.node_names()):
            (self.dir / "spool" / name).mkdir(exist_ok=True)
            gpus = real if real and index == 0 else make_fake_gpus(self.dir / "dev", name, self.spec.gpus_per_node, pool)
            nodes.append({"name": name, "port": self.spec.node_port(index), "gpus": [str(g) for g in gpus]})
        if len(nodes) > (1 if real else 0):
            progress(f"fake GPUs: {self.spec.gpus_per_node} per node from "
                     f"{', '.join(d.source for d in pool[: self.spec.gpus_per_node])}")
        for name, text in self._render_files(nodes).items():
            write_atomic(self.dir / "etc" / name, text)
        write_atomic(self.dir / SPEC_FILE, json.dumps(self.spec.to_json(), indent=2) + "\n")

    def _real_gpus(self, progress: Progress) -> list[Path]:
        """The host's NVIDIA GPUs when the spec asks for them (an error where there are none), else []."""
        if not self.spec.real_gpus:
            return []
        found = nvidia_gpu_devices()
        if not found:
            raise DevClusterError("--real-gpus: this host has no NVIDIA GPU device files (/dev/nvidia0, ...)")
        progress(f"real GPUs on {self.spec.node_names()[0]}: {', '.join(str(p) for p in found)}")
        return found

    def _render_files(self, nodes: list[dict[str, object]] | None = None) -> dict[str, str]:
        """slurm.conf, gres.conf and cgroup.conf as the templates make them for this spec."""
        return render_config_files(self.spec, self.dir, self.slurm_version(), nodes)

    def _check_ports_free(self) -> None:
        wanted = {"slurmctld": self.spec.ctld_port}
        for index, node in enumerate(self.spec.node_names()):
            wanted[f"slurmd-{node}"] = self.spec.node_port(index)
        for daemon, port in wanted.items():
            if self.daemon_pid(daemon) is None and not port_is_free(port):
                raise DevClusterError(
                    f"port {port} (for {daemon}) is in use by another program: "
                    "choose other ports with --ctld-port / --node-base-port"
                )

    def _start(self, argv: list[str], daemon: str) -> None:
        try:
            run_command(argv, env=self.env(), timeout_s=30)
        except SlurmError as exc:
            raise DevClusterError(f"{daemon} did not start: {exc}\n{self.log_tail(daemon)}") from None
        deadline = time.monotonic() + 15.0
        while self.daemon_pid(daemon) is None:  # the pid file appears once it has daemonized
            if time.monotonic() > deadline:
                raise DevClusterError(f"{daemon} did not start\n{self.log_tail(daemon)}")
            time.sleep(0.1)

    def _wait_ready(self, wait_s: float, progress: Progress) -> None:
        deadline = time.monotonic() + wait_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            dead = [d for d in self._daemons() if self.daemon_pid(d) is None]
            if dead:
                raise DevClusterError(f"{dead[0]} exited during start-up\n{self.log_tail(dead[0])}")
            try:
                states = self.node_states()
            except SlurmError:
                states = {}
            waiting = [n for n in self.spec.node_names()
                       if states.get(n, "?").endswith("*") or states.get(n, "?") not in READY_NODE_STATES]
            if not waiting:
                progress(f"dev cluster up: {', '.join(f'{n}={states[n]}' for n in sorted(states))}")
                return
            for node in waiting:
                if states.get(node, "").startswith(("down", "drain")):
                    run_command([self.binary("scontrol"), "update", f"NodeName={node}", "State=RESUME"],
                                env=self.env(), check=False)
            pending = ", ".join(f"{n}={states.get(n, '?')}" for n in waiting)
            progress(f"waiting for nodes: {pending}")
            time.sleep(0.5)
        node = next((n for n in self.spec.node_names() if states.get(n) not in READY_NODE_STATES),
                    self.spec.node_names()[0])
        raise DevClusterError(
            f"node {node} did not become idle within {wait_s:g} s (state {states.get(node, 'unknown')})\n"
            + self.log_tail(f"slurmd-{node}")
        )

    def log_tail(self, daemon: str, lines: int = 15) -> str:
        """The last ``lines`` of ``daemon``'s log, indented under a line naming the file."""
        path = self._log_file(daemon)
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {path})"
        return f"last lines of {path}:\n" + "\n".join("  " + line for line in tail)

    # ---- down --------------------------------------------------------------------------------
    def down(self, *, wait_s: float = 30.0, progress: Progress = lambda _msg: None) -> list[int]:
        """Cancel the cluster's jobs and stop its daemons and their children. Returns the pids stopped."""
        pids = {d: self.daemon_pid(d) for d in self._daemons()}
        if pids["slurmctld"]:
            progress("cancelling jobs")
            for partition in (self.spec.partition, self.spec.preempt_partition, self.spec.urgent_partition):
                run_command([self.binary("scancel"), "--quiet", "--full", "--partition", partition],
                            env=self.env(), check=False, timeout_s=10)
            self._wait_no_jobs(min(wait_s, 15.0))
        procs: list[psutil.Process] = []
        for pid in pids.values():
            if pid is None:
                continue
            try:
                parent = psutil.Process(pid)
                procs.extend(parent.children(recursive=True))
                procs.append(parent)
            except psutil.NoSuchProcess:
                continue
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGTERM)
        _gone, alive = psutil.wait_procs(procs, timeout=wait_s / 3)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(alive, timeout=5)
        for daemon in self._daemons():
            self._pid_file(daemon).unlink(missing_ok=True)
        stopped = [p.pid for p in procs]
        progress(f"stopped {len(stopped)} processes")
        return stopped

    def _wait_no_jobs(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            result = run_command([self.binary("squeue"), "-h", "-o", "%i"], env=self.env(), check=False, timeout_s=10)
            if result.returncode != 0 or not result.stdout.strip():
                return
            time.sleep(0.5)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if nothing listens on ``host:port`` (we can bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True

