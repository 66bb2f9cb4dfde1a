"""The store's mark is written whole or not at all: a temporary file renamed over it. Before,
the first write after each start emptied it (``O_TRUNC``) and then wrote in place, so a kill
between the two left an empty mark, which was not checked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurm_elastic.rollouts.mark import MarkWriter, mark_path, read_mark, write_mark


def test_a_writer_killed_between_its_syscalls_leaves_the_old_mark_whole(tmp_path: Path) -> None:
    """A child writes a new count and is killed at one of the system calls a writer may make (one
    it does not make lets it finish): the mark reads the old count or the new one, never nothing."""
    for stop_at in ("open", "write", "pwrite", "fsync", "close", "replace"):
        write_mark(tmp_path / "q.sqlite", 7)
        script = textwrap.dedent(f"""
            import os, signal
            from pathlib import Path
            from slurm_elastic.rollouts.mark import MarkWriter
            real = getattr(os, {stop_at!r})
            def killed(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)
            setattr(os, {stop_at!r}, killed)
            MarkWriter(Path({str(tmp_path / "q.sqlite")!r})).write(8)
        """)
        done = subprocess.run([sys.executable, "-c", script], check=False)
        assert read_mark(tmp_path / "q.sqlite") == (7 if done.returncode == -9 else 8), stop_at
    MarkWriter(tmp_path / "q.sqlite").write(8)
    assert read_mark(tmp_path / "q.sqlite") == 8


def test_every_write_replaces_the_file_and_leaves_no_temporary_one(tmp_path: Path) -> None:
    writer = MarkWriter(tmp_path / "q.sqlite", fsync=False)
    writer.write(1)
    inode = os.stat(mark_path(tmp_path / "q.sqlite")).st_ino
    writer.write(2)
    assert os.stat(mark_path(tmp_path / "q.sqlite")).st_ino != inode  # renamed into place, not written over
    assert read_mark(tmp_path / "q.sqlite") == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["q.mark"]


def test_a_failed_write_leaves_the_mark_as_it_was(tmp_path: Path) -> None:
    write_mark(tmp_path / "q.sqlite", 3)
    (tmp_path / ".q.mark.tmp").mkdir()  # the temporary file cannot be made
    with pytest.raises(OSError):
        MarkWriter(tmp_path / "q.sqlite").write(4)
    assert read_mark(tmp_path / "q.sqlite") == 3
