"""``POST /rollouts``: a submitted group validated from its raw bytes (pydantic; a large one in a
process of its own), refused with a clear answer, or stored as the exact bytes received and
answered once its group commit is durable. Answered in front of the framework, as a plain ASGI
handler (:class:`SubmitEndpoint`); the models document it in OpenAPI."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Annotated, Any, Generic, NamedTuple, TypeVar

from fastapi import status
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.types import Receive

from slurm_elastic.client.wire import ID, INT64_MAX, WORKER_ID
from slurm_elastic.controller.guard import Headers
from slurm_elastic.controller.http_errors import error_detail, retry_after
from slurm_elastic.rollouts.queue import QueueFull, RolloutQueue, StaleGroup, VersionAhead
from slurm_elastic.rollouts.wire import check_mask_values, check_token_ids

log = logging.getLogger(__name__)
T = TypeVar("T")


def _compact(what: str, max_bytes: int) -> Any:
    """A compact field: ``max_bytes`` decoded."""
    return Field(None, max_length=max_bytes,
                 description=f"{what}, base64 (standard or URL-safe alphabet, padding optional); what the SDK sends")


class Sequence(BaseModel):
    """One scored sequence. Strict types (no numbers as strings, no booleans as numbers), finite
    floats. The compact fields arrive as base64 text and are held decoded; validate with
    ``model_validate_json`` (as the route does), which decodes them."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, val_json_bytes="base64",
                              ser_json_bytes="base64")
    tokens: list[Annotated[int, Field(ge=0, lt=2**31)]] | None = Field(None, max_length=1_000_000, fail_fast=True)
    tokens_b64: bytes | None = _compact("token ids as little-endian int32", 4_000_000)
    mask: list[Annotated[int, Field(ge=0, le=1)]] | None = Field(None, max_length=1_000_000, fail_fast=True)
    mask_b64: bytes | None = _compact("loss mask as one byte (0 or 1) per token", 1_000_000)
    score: float
    logprobs: list[float] | None = Field(None, max_length=1_000_000, fail_fast=True, description="one per token")


class RolloutGroup(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    id: str = Field(pattern=ID, description="unique per group: a retry with the same id is not stored twice")
    worker_id: str = Field(pattern=WORKER_ID)
    policy_version: int = Field(ge=0, le=INT64_MAX)
    group_size: int = Field(ge=1, le=4096)
    sequences: list[Sequence] = Field(min_length=1, max_length=4096)
    metadata: dict[str, Any] = Field(default_factory=dict, description="any JSON; numbers finite")

    @model_validator(mode="after")
    def _consistent(self) -> RolloutGroup:
        """One check per group (each call from the validator core costs): the group's size,
        exactly one token form and at most one mask form per sequence, as many mask values and
        logprobs as tokens, finite numbers in the metadata, then the compact fields' values for
        the whole group at once."""
        if len(self.sequences) != self.group_size:
            raise ValueError(f"group_size is {self.group_size} but {len(self.sequences)} sequences were sent")
        if self.metadata and not finite_json(self.metadata):
            raise ValueError("metadata holds a number that is not finite (NaN or infinite)")
        packed_tokens: list[tuple[int, bytes]] = []
        packed_masks: list[tuple[int, bytes]] = []
        for i, seq in enumerate(self.sequences):
            tokens, tokens_b64, mask, mask_b64 = seq.tokens, seq.tokens_b64, seq.mask, seq.mask_b64
            if tokens_b64 is not None:
                if tokens is not None:
                    raise ValueError(f"sequences[{i}]: give exactly one of tokens or tokens_b64")
                packed_tokens.append((i, tokens_b64))
                n_tokens = len(tokens_b64) // 4
            elif tokens is None:
                raise ValueError(f"sequences[{i}]: give exactly one of tokens or tokens_b64")
            else:
                n_tokens = len(tokens)
            if n_tokens == 0 and not tokens_b64:  # (3 bytes of tokens_b64 are refused below as not whole ids)
                raise ValueError(f"sequences[{i}]: no tokens (a sequence to train on has at least one)")
            if seq.logprobs is not None and len(seq.logprobs) != n_tokens:
                raise ValueError(f"sequences[{i}].logprobs: {len(seq.logprobs)} values for {n_tokens} tokens")
            if mask_b64 is not None:
                if mask is not None:
                    raise ValueError(f"sequences[{i}]: give at most one of mask or mask_b64")
                packed_masks.append((i, mask_b64))
                n_mask = len(mask_b64)
            elif mask is None:
                continue
            else:
                n_mask = len(mask)
            if n_mask != n_tokens:
                raise ValueError(f"sequences[{i}]: the mask has {n_mask} values for {n_tokens} tokens")
        bad = check_token_ids([raw for _i, raw in packed_tokens])
        if bad is not None:
            raise ValueError(f"sequences[{packed_tokens[bad][0]}].tokens_b64 is not whole non-negative int32 "
                             "token ids")
        bad = check_mask_values([raw for _i, raw in packed_masks])
        if bad is not None:
            raise ValueError(f"sequences[{packed_masks[bad][0]}].mask_b64 holds a byte other than 0 or 1")
        return self


def finite_json(value: Any) -> bool:
    """Whether every number in a parsed JSON value is finite (JSON itself has no NaN or infinity)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite_json(v) for v in value.values())
    if isinstance(value, list):
        return all(finite_json(v) for v in value)
    return True


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema with its local ``$defs`` inlined (the route parses the body itself)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return dict(resolve(schema))


JSON = [(b"content-type", b"application/json")]
PARSE_APART_BYTES = 1 << 20  # a submit this large is parsed in the parser process
PARENT_CHECK_S = 1.0  # how often the parser process looks whether the controller still runs
HELD_BODIES_MAX_BYTES = 512 << 20  # submits being received, parsed or stored hold at most this much at once
MAX_CONTAINERS = 1_000_000  # arrays and objects in a submitted group (brackets in strings count too): 32 MiB of
# empty lists took the event loop 10 s and 2.5 GB to parse; a group of token lists holds a few per sequence


def _error(status_code: int, detail: Any, headers: Headers | None = None) -> tuple[int, bytes, Headers]:
    """An error answer shaped like FastAPI's (``{"detail": ...}``)."""
    return status_code, json.dumps({"detail": detail}).encode(), [*JSON, *(headers or [])]


class SubmitEndpoint:
    """``POST /rollouts`` as a plain ASGI handler, after the token and size checks of the
    :class:`RequestGuard`: validation from the raw bytes (422 naming the field, a group larger
    than a batch included), a ``policy_version`` past the trainer's (409) or already stale (200
    ``{"accepted": false, "reason": "stale", ...}``), backpressure (429), then the group commit
    (503 with Retry-After if the store fails: nothing was stored). Answered in front of the framework
    (:class:`ControllerApp`) so the hot route skips its per-request machinery; the FastAPI route
    with the same handler documents it in OpenAPI."""

    def __init__(self, queue: RolloutQueue, held_max_bytes: int | None = None) -> None:
        self.queue = queue
        self.held_bytes = 0  # the bodies of the submits being answered (received so far)
        # the largest group the queue takes always fits
        self.held_max_bytes = held_max_bytes or max(HELD_BODIES_MAX_BYTES, queue.config.max_group_bytes)
        # a large body is parsed in a process of its own, one at a time, started at the first: pydantic
        # holds the GIL while it parses, so in a thread a 16 MB group still held every answer 0.9 s
        self.parser: ProcessPoolExecutor | None = None

    async def answer(self, receive: Receive) -> tuple[int, bytes, Headers]:
        """The answer to one submit. The bodies of all the submits being answered hold at most
        ``held_max_bytes`` at once: past that, a submit gets 503 with Retry-After as its bytes
        arrive (nothing stored), so clients that send large bodies and withhold their last byte
        cannot take the host's memory."""
        chunks: list[bytes] = []
        held = 0
        try:
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return _error(400, "client went away")
                chunk = message.get("body", b"")
                held += len(chunk)
                self.held_bytes += len(chunk)
                if self.held_bytes > self.held_max_bytes:
                    return _error(status.HTTP_503_SERVICE_UNAVAILABLE,
                                  f"the controller holds {self.held_max_bytes >> 20} MiB of submitted groups being "
                                  "received or stored, its limit: nothing was stored, send it again",
                                  [(b"retry-after", b"1"), (b"connection", b"close")])
                chunks.append(chunk)
                if not message.get("more_body"):
                    break
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)  # one chunk: uncopied
            chunks.clear()  # not held twice while it is parsed and stored
            return await self._answer(body)
        finally:
            self.held_bytes -= held

    async def _answer(self, body: bytes) -> tuple[int, bytes, Headers]:
        if len(body) > MAX_CONTAINERS and body.count(b"[") + body.count(b"{") > MAX_CONTAINERS:
            return _error(422, [{"loc": ["body"], "type": "json_invalid",
                                 "msg": f"more than {MAX_CONTAINERS:,} arrays and objects in one group: refused "
                                        "before parsing (it would hold the controller for seconds)"}])
        try:
            group = await self._parse(body)
        except BrokenProcessPool as exc:  # the parser died (killed for its memory?): a new one parses the next
            return _unavailable("(not parsed)", exc)
        if isinstance(group, _Invalid):
            return 422, json.dumps(error_detail(group.errors, group.n_errors, ("body",))).encode(), JSON
        batch_size = self.queue.config.batch_size
        if group.group_size > batch_size:
            return _error(422, [{"loc": ["body", "group_size"], "type": "group_over_batch_size",
                                 "msg": f"group_size (n_seqs) {group.group_size} is over the queue's batch_size "
                                        f"{batch_size}: a batch is made of whole groups, so this group could "
                                        "never be delivered"}])
        waiter: asyncio.Future[tuple[bool, BaseException | None]] = asyncio.get_running_loop().create_future()
        try:
            self.queue.submit_then(group.id, group.worker_id, group.group_size, group.policy_version, body,
                                   _Resolver(waiter))
        except QueueFull as exc:
            return _error(status.HTTP_429_TOO_MANY_REQUESTS, str(exc),
                          [(b"retry-after", str(max(1, round(exc.retry_after_s))).encode())])
        except VersionAhead as exc:  # not stored; the worker's lease gave those sequences back
            await asyncio.get_running_loop().run_in_executor(None, self.queue.save_counts)  # off the loop
            return _error(status.HTTP_409_CONFLICT, [{"loc": ["body", "policy_version"], "msg": str(exc),
                                                      "type": "policy_version_ahead",
                                                      "current_version": exc.current_version}])
        except StaleGroup as exc:  # not stored; the worker's lease gave those sequences back
            await asyncio.get_running_loop().run_in_executor(None, self.queue.save_counts)  # off the loop
            return 200, json.dumps({"accepted": False, "reason": "stale", "detail": str(exc),
                                    "policy_version": exc.policy_version, "current_version": exc.current_version,
                                    "max_staleness": exc.max_staleness}).encode(), JSON
        except Exception as exc:  # the store refused the group at once: nothing was stored, a retry is safe
            return _unavailable(group.id, exc)
        stored, error = await waiter  # answered once its group commit is durable (or failed)
        if error is not None:  # the commit failed: nothing was stored, a retry is safe
            return _unavailable(group.id, error)
        return 200, b'{"accepted":true}' if stored else b'{"accepted":false}', JSON


    async def _parse(self, body: bytes) -> _GroupHead | _Invalid:
        if len(body) < PARSE_APART_BYTES:
            return _group_head(body)
        if self.parser is None:  # spawned: a fork of this process would copy its threads' locks
            self.parser = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                              initializer=_exit_with, initargs=(os.getpid(),))
        parser = self.parser
        try:
            return await asyncio.get_running_loop().run_in_executor(parser, _group_head, body)
        except BrokenProcessPool:
            if self.parser is parser:  # not one made since by a submit that met the same death
                self.parser = None
            raise

    def close(self) -> None:
        """Stop the parser process, if one was started."""
        if self.parser is not None:
            self.parser.shutdown(wait=False, cancel_futures=True)
            self.parser = None


class _GroupHead(NamedTuple):
    id: str
    worker_id: str
    group_size: int
    policy_version: int


class _Invalid(NamedTuple):
    """Why a body is not a group: pydantic's errors (plain values: they cross a process boundary)."""

    errors: list[Any]
    n_errors: int


def _exit_with(parent_pid: int) -> None:
    """In the parser process: exit once the controller that started it is gone (a kill -9 leaves
    the pool's process waiting for work for ever otherwise)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _group_head(body: bytes) -> _GroupHead | _Invalid:
    """``body`` validated as a group, and what the queue needs of it (the parsed group is dropped
    where it was parsed: freeing the millions of objects a large one holds took the event loop
    half a second); or why it is not one."""
    try:
        group = RolloutGroup.model_validate_json(body)
    except ValidationError as exc:
        return _Invalid(exc.errors(include_url=False, include_context=False, include_input=False), exc.error_count())
    return _GroupHead(group.id, group.worker_id, group.group_size, group.policy_version)


def _unavailable(group_id: str, error: BaseException) -> tuple[int, bytes, Headers]:
    log.warning("the rollout store did not take group %s: %s", group_id, error)
    return _error(status.HTTP_503_SERVICE_UNAVAILABLE, f"the rollout store did not take the group: {error}",
                  [(b"retry-after", retry_after(error).encode())])


class _Resolver(Generic[T]):
    """A :data:`Then` that settles ``waiter`` on its loop with ``(result, error)``, without a
    cross-thread wake-up when called on the loop's own thread (the store's group commits are, on
    the loop that serves the submits). The error is a value, never raised into the waiting
    frame: a raised one's traceback would hold that frame, and the frame the waiter that holds
    the error, a cycle keeping the request's body until a rare cyclic collection. An object,
    not a closure, for the same reason: a closure that names itself is such a cycle."""

    __slots__ = ("loop", "loop_thread", "waiter")

    def __init__(self, waiter: asyncio.Future[tuple[T, BaseException | None]]) -> None:
        self.waiter = waiter
        self.loop = waiter.get_loop()
        self.loop_thread = threading.get_ident()

    def __call__(self, result: T, error: BaseException | None) -> None:
        if threading.get_ident() != self.loop_thread:
            self.loop.call_soon_threadsafe(self, result, error)
        elif not self.waiter.cancelled():
            self.waiter.set_result((result, error))
