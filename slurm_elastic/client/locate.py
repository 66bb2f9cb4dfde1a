"""Find a job's controller from the job id alone: its state directory, URL and token, and
whether Slurm says the job still runs (the token goes to no other process)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_elastic.client.files import (
    CONTROLLER_FILE,
    TOKEN_COPY,
    TOKEN_FILE,
    default_state_root,
    job_dirs_of_every_cluster,
    job_state_dir,
    pointed_state_dir,
    read_controller_url,
    read_token_and_file,
    read_token_file,
    token_file_source,
)
from slurm_elastic.errors import (
    ConfigError,
    ControllerNotAskedError,
    ControllerUnreachableError,
    SlurmCommandError,
    SlurmError,
    SlurmUnavailableError,
)
from slurm_elastic.slurm.cli_backend import SlurmCli
from slurm_elastic.slurm.parse import JobInfo

COMMENT_PREFIX = "slurm-elastic:"


# Slurm job states in which the job's processes, and so its controller, can run
CONTROLLER_MAY_RUN = frozenset({"RUNNING", "SUSPENDED", "STOPPED", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING"})
# states before the batch script starts, or starts again after a requeue: a controller.json is an earlier run's
NOT_STARTED = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT",
                         "RESV_DEL_HOLD"})

REWRITTEN = " (a running controller rewrites it at its next start; see `slurm-elastic status` for the job's steps)"


def controller_url(path: Path, info: Any) -> str:
    """The ``url`` of a parsed ``controller.json``; ControllerUnreachableError naming ``path`` if
    it is not a controller file (no ``http://`` or ``https://`` URL, a ``pid`` that is no number)."""
    url = info.get("url") if isinstance(info, dict) else None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ControllerNotAskedError(f"{path} is not a controller file: no http:// URL in it{REWRITTEN}")
    pid = info.get("pid", 0)
    if isinstance(pid, bool) or not isinstance(pid, int):
        raise ControllerNotAskedError(f"{path} is not a controller file: its pid is not a number{REWRITTEN}")
    return url


def read_token(path: Path) -> str:
    """The job's token from ``path`` or its copy; ControllerNotAskedError naming it if
    neither holds one."""
    token = read_token_file(path)
    if not token:
        state = "is empty" if path.exists() else "is missing"
        raise ControllerNotAskedError(
            f"the job's token file {path} {state}, and so is its copy {TOKEN_COPY}: put the file back from a copy, "
            f"or restart the job's controller (kill it: the batch script starts a new one, which writes a new token)")
    return token


@dataclass(frozen=True)
class JobHandle:
    job_id: int
    state_dir: Path
    url: str
    token: str
    info: dict[str, Any]


def job_comment(state_dir: Path) -> str:
    """The Slurm comment a controller sets on its job: how the CLI, the epilog and a restarted
    controller find the job's state directory from the job alone."""
    return f"{COMMENT_PREFIX}{state_dir}"


def state_dir_from_comment(comment: str) -> Path | None:
    if comment.startswith(COMMENT_PREFIX):
        return Path(comment.removeprefix(COMMENT_PREFIX).strip())
    return None


def _slurm_conf() -> Path:
    return Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))


def local_cluster_name() -> str:
    """This cluster's name without asking slurmctld: the job's environment, else ClusterName in
    the local slurm.conf ('' if neither says; a configless node has no local slurm.conf)."""
    name = os.environ.get("SLURM_CLUSTER_NAME", "")
    if name:
        return name
    try:
        text = _slurm_conf().read_text(errors="replace")
    except OSError:
        return ""
    match = re.search(r"^\s*ClusterName\s*=\s*(\S+)", text, re.MULTILINE | re.IGNORECASE)
    return match.group(1) if match else ""


@dataclass(frozen=True)
class DefaultPlaces:
    """Where a job's state directory is by default: this cluster's place for it, or, with no
    cluster name known here, the places of every cluster under the jobs root that hold the job id."""

    dirs: list[Path]
    searched: str = ""  # with no cluster name: what was searched, said when no controller is found
    ambiguous: str = ""  # set when several clusters hold the job id: which, and what to set


def default_places(job_id: int) -> DefaultPlaces:
    """The job's default state directory: this cluster's, else the one cluster directory under the
    jobs root that holds the job id (several: none chosen; ``ambiguous`` says which)."""
    cluster = local_cluster_name()
    if cluster:
        return DefaultPlaces([job_state_dir(cluster, job_id)])
    found = job_dirs_of_every_cluster(job_id)
    searched = (f"{default_state_root() / 'jobs' / '*' / str(job_id)} (no cluster name here: SLURM_CLUSTER_NAME is "
              f"unset and {_slurm_conf()} gives no ClusterName)")
    if len(found) <= 1:
        return DefaultPlaces(found, searched)
    clusters = ", ".join(d.parent.name for d in found)
    return DefaultPlaces([], searched, f"clusters {clusters} each have a job {job_id} ({', '.join(map(str, found))}): "
                                     "set SLURM_CLUSTER_NAME to the job's cluster")


class JobEndedError(ControllerUnreachableError):
    """Slurm says the job has ended: no controller of it runs, whatever its controller.json says."""


@dataclass(frozen=True)
class SlurmView:
    """What Slurm said of a job, asked once per command: its record, or why Slurm did not answer."""

    job: JobInfo | None
    error: str = ""  # Slurm itself did not answer (slurmctld down or hung)


def ask_slurm(job_id: int, slurm: SlurmCli) -> SlurmView:
    """Slurm's record of the job; SlurmError if Slurm answered that it does not know the job
    (naming what the job left here, if it did)."""
    try:
        return SlurmView(slurm.job_info(job_id))
    except (SlurmCommandError, SlurmUnavailableError) as exc:
        return SlurmView(None, f"Slurm did not answer: {exc}")
    except SlurmError as exc:
        raise SlurmError(f"{exc}{left_behind(job_id)}") from None


def left_behind(job_id: int) -> str:
    """Where an ended job's state directory is on this cluster's default place, if it is there."""
    dirs = default_places(job_id).dirs
    if not dirs or not (dirs[0] / "state.json").exists():
        return ""
    return f"; what it left is in {dirs[0]} (state.json: its workers and their history; logs/: each worker's output)"


def locate(job_id: int, slurm: SlurmCli | None = None, view: SlurmView | None = None) -> JobHandle:
    """The job's controller as published in its state directory: the default place for this
    cluster, else what Slurm says (the job's cluster and the state directory in its comment),
    else the configured directory its controller named in the default place.
    With ``view``, Slurm is not asked again."""
    places = default_places(job_id)
    candidates = list(places.dirs)
    pointed = pointed_state_dir(candidates[0]) if candidates else None  # controller.state_dir, named here
    if not any((c / CONTROLLER_FILE).exists() for c in candidates):
        if view is None:
            try:
                view = ask_slurm(job_id, slurm or SlurmCli())
            except SlurmError as exc:
                view = SlurmView(None, str(exc))
        job = view.job
        if job is not None:
            comment_dir = state_dir_from_comment(job.comment)
            candidates += [d for d in (comment_dir, job_state_dir(job.cluster, job_id))
                           if d is not None and d not in candidates]
        if pointed is not None and pointed not in candidates:  # after what Slurm names: while it does not answer
            candidates.append(pointed)
    for state_dir in candidates:
        path = state_dir / CONTROLLER_FILE
        try:
            info = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            raise ControllerNotAskedError(f"cannot read {path}: {exc}{REWRITTEN}") from None
        return JobHandle(job_id, state_dir, controller_url(path, info), read_token(state_dir / TOKEN_FILE), info)
    why = f"; {view.error} (is SLURM_CONF set for this job's cluster?)" if view is not None and view.error else ""
    if view is not None and view.job is not None and state_dir_from_comment(view.job.comment) is None:
        why += (f"; Slurm's job {job_id} ({view.job.state}) carries no slurm-elastic comment: not a slurm-elastic "
                "job, or one whose controller has not started yet")
    if places.ambiguous:
        why += f"; {places.ambiguous}"
    looked = ([places.searched] if places.searched else []) + [str(c) for c in candidates]
    raise ControllerUnreachableError(f"no controller found for job {job_id} (looked in {', '.join(looked)}){why}")


def locate_running(job_id: int, view: SlurmView) -> JobHandle:
    """The job's controller, if Slurm's ``view`` lets one run: JobEndedError for a job that has
    ended, ControllerUnreachableError for one whose batch script has not started (again) -- the
    job's token is never handed to a URL that an ended job left behind. When Slurm did not answer
    (``view.error``), the controller file's word is taken: the caller warns."""
    state = view.job.state if view.job is not None else ""
    if view.job is None or state in CONTROLLER_MAY_RUN:
        return locate(job_id, view=view)
    try:
        where = f"to {locate(job_id, view=view).url}"
    except ControllerUnreachableError:  # no or a damaged controller file: nothing to send to anyway
        where = "anywhere"
    if state in NOT_STARTED:
        raise ControllerUnreachableError(f"job {job_id} is {state}: its controller does not run (yet, or again "
                                         f"after a requeue); not sending the job's token {where}")
    raise JobEndedError(f"job {job_id} ended ({state}): its controller is gone; not sending the job's token {where}"
                        f"{left_behind(job_id)}")


@dataclass(frozen=True)
class ControllerAddress:
    """Where a client inside the job reaches its controller."""

    url: str
    token: str
    state_dir: Path | None  # None: only the URL and token were given; a moved controller is not followed
    token_source: str = ""  # where the token came from (a variable, a file), said when it is refused


def controller_from_env(env: Mapping[str, str] | None = None) -> ControllerAddress:
    """The controller of the job this process runs in (the trainer step, a router, any client):
    from ``SLURM_ELASTIC_STATE_DIR``, else from the job's state directory found from
    ``SLURM_JOB_ID`` alone (:func:`locate`); ``SLURM_ELASTIC_CONTROLLER_URL`` and
    ``SLURM_ELASTIC_TOKEN_FILE`` (or ``SLURM_ELASTIC_TOKEN``) win over what that directory holds.
    ConfigError saying what to set when nothing names the controller or its token."""
    env = os.environ if env is None else env
    state = env.get("SLURM_ELASTIC_STATE_DIR", "")
    url = env.get("SLURM_ELASTIC_CONTROLLER_URL", "")
    token = env.get("SLURM_ELASTIC_TOKEN", "")
    token_file = env.get("SLURM_ELASTIC_TOKEN_FILE", "")
    named = "SLURM_ELASTIC_TOKEN_FILE ({})" if token_file else "the job's token file {}"
    job_id = env.get("SLURM_JOB_ID", "")
    if not state and job_id.isdigit():  # its state directory: a restarted controller is followed there
        try:
            state = str(locate(int(job_id)).state_dir)
        except ControllerUnreachableError:
            if not (url and (token or token_file)):
                raise
    state_dir = Path(state) if state else None
    url = url or (read_controller_url(state_dir) if state_dir else "")
    if not token_file and state_dir is not None:
        token_file = str(state_dir / TOKEN_FILE)
    if not url:
        where = f"{state_dir / CONTROLLER_FILE} names no controller URL" if state_dir else "nothing names the controller"
        raise ConfigError(f"{where}: run inside the job (SLURM_JOB_ID), or set SLURM_ELASTIC_STATE_DIR, "
                          "or SLURM_ELASTIC_CONTROLLER_URL with SLURM_ELASTIC_TOKEN_FILE (or SLURM_ELASTIC_TOKEN)")
    source = "SLURM_ELASTIC_TOKEN"
    if not token and token_file:
        token, read = read_token_and_file(Path(token_file))
        source = token_file_source(named.format(token_file), Path(token_file), read)
    if not token:
        raise ConfigError(f"the job's token file {token_file} is missing or empty, and so is its copy" if token_file
                          else "no token for the controller: set SLURM_ELASTIC_TOKEN_FILE (or SLURM_ELASTIC_TOKEN)")
    return ControllerAddress(url, token, state_dir, source)
