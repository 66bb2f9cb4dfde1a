"""The body timer's refusal and the app: an app told that the client went away must not return
before the 408 has left, or the server answers 500 in its place (seen on a loaded 2-core CI run
of test_api_hostile_clients.py). Driven here with an event loop and no server, so the order is
forced rather than left to load."""

from __future__ import annotations

import asyncio

from starlette.types import Message

from slurm_elastic.controller.guard import RequestGuard

SCOPE = {"type": "http", "path": "/admin/scale", "method": "POST",
         "headers": [(b"authorization", b"Bearer t"), (b"content-length", b"1000")]}


async def trickled_past_the_timer() -> list[str]:
    """What the app hears when a byte arrives after the body's time ran out, then what had been
    sent to the client by that moment."""
    chunks: asyncio.Queue[Message] = asyncio.Queue()
    sent: list[Message] = []

    async def receive() -> Message:
        return await chunks.get()

    async def send(message: Message) -> None:
        await asyncio.sleep(0)  # a server's send yields to the loop, as uvicorn's does
        sent.append(message)

    passed = await RequestGuard("t", submit_max_bytes=1 << 20, body_timeout_s=0.05)(SCOPE, receive, send)
    assert passed is not None
    app_receive, _ = passed
    chunks.put_nowait({"type": "http.request", "body": b"{", "more_body": True})
    await app_receive()  # the app starts reading: the timer starts
    timer = app_receive.__self__._timer  # type: ignore[attr-defined]
    # the next byte arrives in the very loop turn the timer fires in: the app's wait ends then too
    asyncio.get_running_loop().call_at(timer.when(), chunks.put_nowait,
                                       {"type": "http.request", "body": b" ", "more_body": True})
    heard = (await app_receive())["type"]
    return [heard, *(str(m.get("status", "body")) for m in sent)]


def test_the_408_has_left_before_the_app_hears_the_client_went_away() -> None:
    assert asyncio.run(trickled_past_the_timer()) == ["http.disconnect", "408", "body"]


def _check(path: str, method: str, content_length: bytes) -> tuple[int, bytes] | None:
    scope = {"type": "http", "path": path, "method": method,
             "headers": [(b"authorization", b"Bearer t"), (b"content-length", content_length)]}
    answer, *_ = RequestGuard("t", submit_max_bytes=32 << 20).check(scope)
    return None if answer is None else (answer[0], answer[1])


def test_the_submit_cap_is_the_submit_route_and_method_s_alone() -> None:
    assert _check("/rollouts", "POST", b"%d" % (32 << 20)) is None
    for method in ("PUT", "GET", "PATCH", "DELETE"):  # answered 405: they get the control routes' cap
        assert _check("/rollouts", method, b"%d" % (32 << 20)) == (413, b'{"detail": "request body over 1048576 bytes"}')


def test_content_length_with_whitespace_is_its_number_and_one_that_is_no_number_is_said_so() -> None:
    assert _check("/admin/scale", "POST", b"13 ") is None and _check("/admin/scale", "POST", b"\t13") is None
    assert _check("/admin/scale", "POST", b"1e3") == (400, b'{"detail": "Content-Length is not a whole number of bytes"}')
