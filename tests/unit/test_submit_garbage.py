"""The hot route leaves nothing for the cyclic garbage collector: under load, every object a
submit allocates must be freed by reference counting, or the collector pauses the event loop
(a closure that named itself once cost 10-40 ms pauses every few hundred milliseconds)."""

from __future__ import annotations

import asyncio
import gc
import json
from pathlib import Path

import pytest
from starlette.types import Message

from slurm_elastic.controller.submit import SubmitEndpoint
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.rollouts.wire import pack_group


def body(group_id: str) -> bytes:
    group = {"id": group_id, "worker_id": "0001", "policy_version": 0, "group_size": 2,
             "sequences": [{"tokens": [5, 6, 7], "mask": [0, 1, 1], "score": 1.0}] * 2}
    return json.dumps(pack_group(group)).encode()


def test_submits_leave_no_reference_cycles(tmp_path: Path) -> None:
    queue = RolloutQueue(RolloutStore(tmp_path / "q.sqlite"), QueueConfig(batch_size=2, capacity_seqs=1000))
    endpoint = SubmitEndpoint(queue)

    async def submit(group_id: str) -> tuple[int, bytes]:
        async def receive() -> Message:
            return {"type": "http.request", "body": body(group_id), "more_body": False}
        code, answer, _headers = await endpoint.answer(receive)
        return code, answer

    async def scenario() -> list[tuple[int, bytes]]:
        await submit("warm-up")  # the syncer and the staging buffer are made once
        gc.collect()
        answers = list(await asyncio.gather(*(submit(f"g{i}") for i in range(50))))
        answers.append(await submit("g0"))  # a duplicate takes the other answer's path
        return answers

    gc.disable()
    try:
        answers = asyncio.run(scenario())
        leftovers = gc.collect()
    finally:
        gc.enable()
        queue.store.close()
    assert answers[:-1] == [(200, b'{"accepted":true}')] * 50
    assert answers[-1] == (200, b'{"accepted":false}')
    assert leftovers == 0, f"{leftovers} objects in reference cycles after 51 submits (11 a submit before the fix)"


def test_refused_submits_leave_no_reference_cycles(tmp_path: Path) -> None:
    """429 (full), 409 (a version past the trainer's) and stale: a refusal raised from a local
    variable was a cycle holding the request's body, so refused resends piled their bodies up
    (a live job grew by about the body's size per refusal, to 23 GB)."""
    queue = RolloutQueue(RolloutStore(tmp_path / "q.sqlite"), QueueConfig(batch_size=2, capacity_seqs=2,
                                                                          max_staleness=0))
    endpoint = SubmitEndpoint(queue)

    async def submit(group_id: str, version: int) -> int:
        text = json.loads(body(group_id))
        text["policy_version"] = version

        async def receive() -> Message:
            return {"type": "http.request", "body": json.dumps(text).encode(), "more_body": False}
        code, _answer, _headers = await endpoint.answer(receive)
        return code

    async def scenario() -> list[int]:
        assert await submit("fills", 0) == 200
        queue.set_version(1)  # version 0 is stale now (max_staleness 0); the buffer is full
        await submit("warm-up", 5)
        gc.collect()
        return [*[await submit(f"ahead{i}", 5) for i in range(5)], *[await submit(f"stale{i}", 0) for i in range(5)],
                *[await submit(f"full{i}", 1) for i in range(5)]]

    gc.disable()
    try:
        codes = asyncio.run(scenario())
        leftovers = gc.collect()
    finally:
        gc.enable()
        queue.store.close()
    assert codes == [409] * 5 + [200] * 5 + [429] * 5
    assert leftovers == 0, f"{leftovers} objects in reference cycles after 15 refused submits"


def test_a_failed_commit_leaves_no_reference_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit that fails (a full disk, the syncer gone) answers 503; its error, once raised into
    the waiting frame, made a cycle through that frame's future that held the body (a live audit:
    10 failed 2.8 MB submits held 49 MB)."""
    import logging

    from slurm_elastic.rollouts.store import StoreUnavailableError

    # pytest keeps every log record, and a record's arguments would keep the error reachable
    monkeypatch.setattr(logging.getLogger("slurm_elastic.controller.submit"), "disabled", True)

    queue = RolloutQueue(RolloutStore(tmp_path / "q.sqlite"), QueueConfig(batch_size=2, capacity_seqs=1000))
    endpoint = SubmitEndpoint(queue)

    def failing_commit(*args: object) -> None:  # as the store's commit reader fails a commit, on the loop
        then = args[-1]
        then(None, StoreUnavailableError("commit failed: disk full"))  # type: ignore[operator]

    queue.store.submit = failing_commit  # type: ignore[method-assign,assignment]

    async def submit(group_id: str) -> int:
        async def receive() -> Message:
            return {"type": "http.request", "body": body(group_id), "more_body": False}
        code, _answer, _headers = await endpoint.answer(receive)
        return code

    async def scenario() -> tuple[list[int], int]:
        await submit("warm-up")
        gc.collect()
        codes = [await submit(f"g{i}") for i in range(10)]
        return codes, gc.collect()  # on the loop: its teardown would free what the requests left

    gc.disable()
    try:
        codes, leftovers = asyncio.run(scenario())
    finally:
        gc.enable()
        queue.store.close()
    assert codes == [503] * 10
    assert leftovers == 0, f"{leftovers} objects in reference cycles after 10 failed commits"


def test_bodies_withheld_past_the_memory_limit_get_503_and_the_bytes_are_given_back(tmp_path: Path) -> None:
    """A token holder sent 30 MiB bodies without their last byte on 100 connections: the
    controller grew by 3 GB (to the host's memory, with more), each held until its 30 s timeout
    (a hostile-client audit)."""
    queue = RolloutQueue(RolloutStore(tmp_path / "q.sqlite"), QueueConfig(batch_size=2, capacity_seqs=1000))
    endpoint = SubmitEndpoint(queue, held_max_bytes=1000)
    release = asyncio.Event()

    async def withheld() -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        parts = [{"type": "http.request", "body": b" " * 600, "more_body": True}]

        async def receive() -> Message:
            if parts:
                return parts.pop()
            await release.wait()
            return {"type": "http.disconnect"}
        return await endpoint.answer(receive)

    async def whole(group_id: str) -> int:
        async def receive() -> Message:
            return {"type": "http.request", "body": body(group_id), "more_body": False}
        code, _answer, _headers = await endpoint.answer(receive)
        return code

    async def scenario() -> tuple[int, tuple[int, bytes, list[tuple[bytes, bytes]]], int, int]:
        first = asyncio.create_task(withheld())
        await asyncio.sleep(0)
        refused = await withheld()  # 600 + 600 > 1000
        small = await whole("g1")  # its ~200 bytes fit beside the first's 600
        release.set()
        await first
        return small, refused, endpoint.held_bytes, await whole("g2")

    try:
        small, (code, answer, headers), held_after, later = asyncio.run(scenario())
    finally:
        queue.store.close()
    assert code == 503 and (b"retry-after", b"1") in headers and b"nothing was stored" in answer
    assert (small, later, held_after) == (200, 200, 0)


def test_a_large_group_is_parsed_in_a_process_of_its_own_and_a_dead_parser_is_replaced(tmp_path: Path) -> None:
    """pydantic holds the GIL while it parses: in a thread, a 16 MB group held every answer of the
    API 0.9 s (a hostile-client audit: 4 clients resending 30 MB groups kept status answers 4 s
    late). The parse now runs in a process; its refusals cross back whole."""
    queue = RolloutQueue(RolloutStore(tmp_path / "q.sqlite"), QueueConfig(batch_size=2, capacity_seqs=1000))
    endpoint = SubmitEndpoint(queue)
    tokens = list(range(300_000))
    large = {"id": "big", "worker_id": "0001", "policy_version": 0, "group_size": 2,
             "sequences": [{"tokens": tokens, "score": 1.0}] * 2}
    bad = {**large, "id": "bad", "metadata": {"x": float("nan")}}

    async def submit(group: dict[str, object]) -> tuple[int, bytes]:
        raw = json.dumps(group).encode()
        assert len(raw) > (1 << 20)

        async def receive() -> Message:
            return {"type": "http.request", "body": raw, "more_body": False}
        code, answer, _headers = await endpoint.answer(receive)
        return code, answer

    try:
        assert asyncio.run(submit(large)) == (200, b'{"accepted":true}')
        assert endpoint.parser is not None
        code, answer = asyncio.run(submit(bad))
        assert code == 422 and "not finite" in answer.decode(), answer
        for process in list(endpoint.parser._processes.values()):  # killed (its memory, say)
            process.kill()
            process.join()
        assert asyncio.run(submit({**large, "id": "after"}))[0] == 503
        assert asyncio.run(submit({**large, "id": "after"})) == (200, b'{"accepted":true}')
    finally:
        endpoint.close()
        queue.store.close()


PARSER_OWNER = """
import asyncio, json, sys
from pathlib import Path
from slurm_elastic.controller.submit import SubmitEndpoint
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.store import RolloutStore

async def main():
    queue = RolloutQueue(RolloutStore(Path(sys.argv[1]) / "q.sqlite"), QueueConfig(batch_size=2, capacity_seqs=100))
    endpoint = SubmitEndpoint(queue)
    body = json.dumps({"id": "g", "worker_id": "0001", "policy_version": 0, "group_size": 1,
                       "sequences": [{"tokens": list(range(300000)), "score": 1.0}]}).encode()
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}
    print((await endpoint.answer(receive))[0], *endpoint.parser._processes, flush=True)
    await asyncio.sleep(600)

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_the_parser_process_ends_with_a_controller_killed_under_it(tmp_path: Path) -> None:
    """Before, a kill -9 of the controller left its parser process waiting for work until the job
    ended: one more for every restart."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "owner.py"
    script.write_text(PARSER_OWNER)
    owner = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    assert owner.stdout is not None
    code, parser_pid = owner.stdout.readline().split()
    assert code == "200"
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(int(parser_pid), 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(int(parser_pid), signal.SIGKILL)
    raise AssertionError("the parser process outlived its controller by 30 s")


def test_the_largest_group_the_queue_takes_always_fits_in_the_bodies_held(tmp_path: Path) -> None:
    """A queue configured for groups above the default budget answered every such group 503,
    for as long as its worker resent it (a code review)."""
    config = QueueConfig(batch_size=2, capacity_seqs=100, max_group_bytes=1 << 30, capacity_bytes=2 << 30)
    queue = RolloutQueue(RolloutStore(tmp_path / "q.sqlite"), config)
    try:
        assert SubmitEndpoint(queue).held_max_bytes == 1 << 30
    finally:
        queue.store.close()
