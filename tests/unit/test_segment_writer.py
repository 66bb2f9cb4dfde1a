"""The syncer's segment writer, in process on real files: direct writes in whole blocks keep
every byte already on disk, leave only zero padding after the last record, read the block's
head back when they did not write it themselves, and fall back to the page cache where the
filesystem refuses direct I/O."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.rollouts import syncer
from slurm_elastic.rollouts.segments import (
    BLOCK_BYTES,
    StagingBuffer,
    block_end,
    encode_record,
    is_padding,
    records_bytes,
    scan,
    seal_records,
    segment_name,
)
from slurm_elastic.rollouts.syncer import SegmentWriter

SIZES = [10, 5000, 300, 4096 - 16 - 9, 1, 9000, 0, 2500]  # across, onto and within block boundaries


def commit(writer: SegmentWriter, staging: StagingBuffer, number: int, offset: int, seq: int, size: int) -> bytes:
    """Stage one record as the controller does, seal and write it as the syncer does; the record."""
    head, payload = b'{"seq":%d}' % seq, b"x" * size
    _nbytes, _at = staging.stage([head], [payload], offset % BLOCK_BYTES)
    assert staging.map is not None
    lead = offset % BLOCK_BYTES
    seal_records(staging.map, lead, lead + records_bytes([head], [payload]))
    writer.write(staging.map, number, offset, records_bytes([head], [payload]))
    return encode_record(json.loads(head), payload)


def write_commits(tmp_path: Path, writer: SegmentWriter, reopen_every: int = 0) -> bytes:
    staging = StagingBuffer(BLOCK_BYTES)
    (tmp_path / segment_name(1)).touch()
    written = b""
    for seq, size in enumerate(SIZES):
        if reopen_every and seq % reopen_every == 0:
            writer.close()  # as a new syncer: it has to read the block's head back
        written += commit(writer, staging, 1, len(written), seq, size)
    writer.close()
    staging.close()
    return written


@pytest.mark.parametrize("reopen_every", [0, 3])
def test_direct_writes_keep_every_byte_and_pad_with_zeros(tmp_path: Path, reopen_every: int) -> None:
    writer = SegmentWriter(str(tmp_path), direct=True)
    written = write_commits(tmp_path, writer, reopen_every)
    assert writer.direct, "this filesystem refused direct I/O: the test proves nothing here"
    data = (tmp_path / segment_name(1)).read_bytes()
    assert data[:len(written)] == written
    assert len(data) == block_end(len(written)) and is_padding(tmp_path / segment_name(1), len(written))
    records, end = scan(tmp_path / segment_name(1))
    assert [r.head["seq"] for r in records] == list(range(len(SIZES))) and end == len(written)


def test_without_direct_io_the_page_cache_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path: str, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(syncer.os, "open", no_direct)
    writer = SegmentWriter(str(tmp_path), direct=True)
    written = write_commits(tmp_path, writer)
    assert not writer.direct
    assert (tmp_path / segment_name(1)).read_bytes() == written  # no padding either


def test_a_refused_direct_write_is_done_through_the_page_cache(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    real_pwrite = os.pwrite
    refused = []

    def refuse_once(fd: int, data: Any, offset: int) -> int:
        if not refused:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(syncer.os, "pwrite", refuse_once)
    writer = SegmentWriter(str(tmp_path), direct=True)
    written = write_commits(tmp_path, writer)
    assert refused == [0] and not writer.direct
    assert (tmp_path / segment_name(1)).read_bytes() == written


def test_an_older_segment_may_end_in_padding_but_not_in_anything_else(tmp_path: Path) -> None:
    path = tmp_path / segment_name(1)
    record = encode_record({"seq": 1}, b"body")
    path.write_bytes(record + bytes(BLOCK_BYTES - len(record)))
    assert is_padding(path, len(record))
    path.write_bytes(record + bytes(BLOCK_BYTES - len(record) - 1) + b"x")
    assert not is_padding(path, len(record))
    path.write_bytes(record + bytes(BLOCK_BYTES))  # past the block boundary: not what a write leaves
    assert not is_padding(path, len(record))


@pytest.mark.parametrize("sync_left", [True, False])
def test_a_segment_left_for_the_next_is_fdatasynced_with_fsync_os(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync_left: bool) -> None:
    """With ``fsync = "os"`` commits are not synced one by one; the segment the writes leave is, once,
    so a power cut cannot tear an older segment (the store refuses to open one)."""
    synced: list[int] = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real_fdatasync(fd))[1])
    writer = SegmentWriter(str(tmp_path), direct=False, sync_left=sync_left)
    staging = StagingBuffer(BLOCK_BYTES)
    for number in (1, 2):
        (tmp_path / segment_name(number)).touch()
    commit(writer, staging, 1, 0, 0, 100)
    commit(writer, staging, 1, 4096, 1, 100)
    assert synced == []  # not per commit
    first_fd = writer.fd
    commit(writer, staging, 2, 0, 2, 100)
    assert synced == ([first_fd] if sync_left else [])
    writer.close()
    staging.close()
