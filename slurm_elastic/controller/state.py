"""The job's state directory and the controller's state file (what Slurm cannot hold).

Slurm is the source of truth for what runs; this file keeps what it cannot: worker records and
their history, cordons, the autoscaler's memory, manual overrides. Written atomically (write,
fsync, rename). Loading validates it (controller/state_model.py): a file that cannot be this
job's state is moved aside, one that is partly bad keeps what validates; either way the notes say
what happened, and running workers are adopted from Slurm's listing, so none is ever lost.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from slurm_elastic.controller.files import write_json_atomic
from slurm_elastic.controller.state_model import RestoredState, restore_state

STATE_FORMAT = "slurm-elastic-controller-state"
STATE_VERSION = 1


class StateFile:
    """``state.json`` in the job's state directory."""

    def __init__(self, path: Path, job_id: int) -> None:
        self.path = path
        self.job_id = job_id

    @property
    def previous(self) -> Path:
        """The state the last save replaced (``state.json.previous``)."""
        return self.path.with_name(self.path.name + ".previous")

    def load(self) -> RestoredState:
        """The saved state, validated; where ``state.json`` is missing or cannot be this job's
        state, the one saved before it (:attr:`previous`), said in a note; an empty one if
        neither is there.

        A file that cannot be this job's state at all (not JSON, not ours, another job's, no state
        object) is moved aside and said in a note. Otherwise every section and record that
        validates is kept, the rest is noted, and the file as it was is kept beside it. A file
        from a newer version is read the same way, for the fields this version knows.
        """
        restored = self._read()
        older = StateFile(self.previous, self.job_id)._read() if not restored.found else RestoredState()
        if older.found:
            why = restored.notes or (f"{self.path.name} is missing",)
            return replace(older, notes=(*why, f"restored from {self.previous.name}, the state the last save "
                                               "replaced (cordons, targets and pauses as they were then)",
                                         *older.notes))
        if restored.found or not (notes := (*restored.notes, *older.notes)):
            return restored
        return replace(restored, notes=(*notes[:-1], f"{notes[-1]} and rebuilt from Slurm's listing"))

    def _read(self) -> RestoredState:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return RestoredState()
        except (OSError, UnicodeDecodeError) as exc:
            return self._unreadable(f"cannot read state file {self.path}: {exc}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            return self._unreadable(f"state file {self.path} is corrupt (not JSON: {exc})")
        if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
            return self._unreadable(f"state file {self.path} is not a slurm-elastic controller state file")
        version, job_id, body = data.get("version"), data.get("job_id"), data.get("state")
        if type(job_id) is not int or job_id != self.job_id:
            return self._unreadable(f"state file {self.path} belongs to job {job_id!r}, not {self.job_id}")
        if type(version) is not int or version < 1:
            return self._unreadable(f"state file {self.path} has version {version!r}, expected {STATE_VERSION}")
        if not isinstance(body, dict):
            return self._unreadable(f"state file {self.path} has no state object")
        restored = restore_state(body)
        notes = list(restored.notes)
        if version > STATE_VERSION:
            notes.insert(0, f"state file version {version} is newer than this controller's ({STATE_VERSION}): "
                            "read what this version knows")
        if notes:
            kept = self._keep_copy("newer" if version > STATE_VERSION else "partial")
            notes = [f"{self.path.name}: {n}" for n in notes] + [f"the file as it was is kept as {kept.name}"]
        return replace(restored, notes=tuple(notes), found=True)

    def save(self, state: dict[str, Any]) -> None:
        write_json_atomic(self.path, {"format": STATE_FORMAT, "version": STATE_VERSION,
                                      "job_id": self.job_id, "saved_at": time.time(), "state": state}, indent=None,
                          previous=self.previous)

    def _unreadable(self, why: str) -> RestoredState:
        moved = self.move_aside()
        return RestoredState(notes=(f"{why}; moved to {moved.name}",), dropped=True)

    def _aside(self, kind: str) -> Path:
        stamp = int(time.time())
        target = self.path.with_name(f"{self.path.name}.{kind}-{stamp}")
        n = 1
        while target.exists():
            n += 1
            target = self.path.with_name(f"{self.path.name}.{kind}-{stamp}-{n}")
        return target

    def move_aside(self) -> Path:
        """Rename a bad file out of the way (kept for inspection); returns its new path."""
        target = self._aside("corrupt")
        os.replace(self.path, target)
        return target

    def _keep_copy(self, kind: str) -> Path:
        target = self._aside(kind)
        shutil.copy2(self.path, target)
        return target
