"""What a submit may carry, tried on the controller's real HTTP server over a real rollout store:
strict types and finite numbers (422 naming the field), integers the store can hold (one bad
group never fails the good ones committed with it), no group larger than a batch, and a store
failure answered 503 with Retry-After."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slurm_elastic.controller.config import parse_config
from slurm_elastic.errors import ConfigError
from tests.unit.served_controller import ServedController

TOKEN = "validation-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
BATCH_SIZE = 8


class Served(ServedController):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, TOKEN, batch_size=BATCH_SIZE, gpus=(0,))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server = Served(tmp_path_factory.mktemp("served"))
    yield server
    server.close()


def group(gid: str, n: int = 2, **fields: Any) -> dict[str, Any]:
    return {"id": gid, "worker_id": "0001", "policy_version": 0, "group_size": n,
            "sequences": [{"tokens": [1, 2, 3], "mask": [0, 1, 1], "score": 0.5} for _ in range(n)], **fields}


def submit(served: Served, body: bytes) -> httpx.Response:
    return httpx.post(served.url + "/rollouts", content=body, headers=AUTH, timeout=30)


def test_one_group_over_what_the_store_holds_fails_alone(served: Served) -> None:
    bodies = [json.dumps(group(f"batch-{i}", policy_version=2**63 if i == 7 else 0)).encode() for i in range(16)]

    async def all_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=served.url, headers=AUTH, timeout=30) as http:
            return list(await asyncio.gather(*(http.post("/rollouts", content=b) for b in bodies)))

    answers = asyncio.run(all_at_once())
    assert answers[7].status_code == 422 and "policy_version" in answers[7].text, answers[7].text
    assert [a.status_code for i, a in enumerate(answers) if i != 7] == [200] * 15
    served.queue.set_version(2**63 - 1, recovered=True)  # a group may only name a version the trainer reached
    try:
        assert submit(served, json.dumps(group("top", policy_version=2**63 - 1)).encode()).status_code == 200
    finally:
        served.queue.set_version(0, recovered=True)


SEQ = '{"tokens":[1,2,3],"mask":[0,1,1],"score":0.5}'


@pytest.mark.parametrize(("what", "sequence", "named"), [
    ("score NaN", SEQ.replace("0.5", "NaN"), "score"),
    ("score Infinity", SEQ.replace("0.5", "Infinity"), "score"),
    ("score -Infinity", SEQ.replace("0.5", "-Infinity"), "score"),
    ("score 1e999", SEQ.replace("0.5", "1e999"), "score"),
    ("score as a string", SEQ.replace("0.5", '"1e3"'), "score"),
    ("score true", SEQ.replace("0.5", "true"), "score"),
    ("tokens as strings", SEQ.replace("[1,2,3]", '["1","2","3"]'), "tokens"),
    ("tokens as booleans", SEQ.replace("[1,2,3]", "[true,false,true]"), "tokens"),
    ("tokens as floats", SEQ.replace("[1,2,3]", "[1.0,2.0,3.0]"), "tokens"),
    ("mask as booleans", SEQ.replace("[0,1,1]", "[false,true,true]"), "mask"),
    ("logprobs longer than the tokens", SEQ[:-1] + ',"logprobs":[-1.0,-1.0,-1.0,-1.0]}', "logprobs"),
    ("logprobs shorter than the tokens", SEQ[:-1] + ',"logprobs":[-1.0]}', "logprobs"),
    ("logprobs NaN", SEQ[:-1] + ',"logprobs":[-1.0,NaN,-1.0]}', "logprobs"),
    ("logprobs as strings", SEQ[:-1] + ',"logprobs":["-1","-1","-1"]}', "logprobs"),
    ("no tokens", '{"tokens":[],"score":0.5}', "sequences[1]: no tokens"),
    ("no tokens, compact", '{"tokens_b64":"","score":0.5}', "sequences[1]: no tokens"),
])
def test_loose_types_are_refused_naming_the_field(served: Served, what: str, sequence: str, named: str) -> None:
    body = ('{"id":"loose","worker_id":"0001","policy_version":0,"group_size":2,"sequences":['
            + SEQ + "," + sequence + "]}").encode()
    answer = submit(served, body)
    assert answer.status_code == 422, (what, answer.text)
    assert named in answer.text, (what, answer.text)


@pytest.mark.parametrize(("what", "fields", "named"), [
    ("policy_version as a string", {"policy_version": "3"}, "policy_version"),
    ("policy_version 2^63", {"policy_version": 2**63}, "policy_version"),
    ("group_size as a float", {"group_size": 2.0}, "group_size"),
    ("worker_id as a number", {"worker_id": 1}, "worker_id"),
    ("metadata with 1e999", {"metadata": {"reward_parts": [1.0, 1e999]}}, "metadata"),
])
def test_loose_group_fields_are_refused_naming_the_field(served: Served, what: str, fields: dict[str, Any],
                                                         named: str) -> None:
    answer = submit(served, json.dumps(group("loose-group", **fields)).encode())
    assert answer.status_code == 422, (what, answer.text)
    assert named in answer.text, (what, answer.text)


def test_the_sdk_form_and_finite_values_still_pass(served: Served) -> None:
    from slurm_elastic.rollouts.wire import pack_group

    plain = group("fine", metadata={"env": "gsm8k", "parts": [0.5, -1, 2e300]})
    plain["sequences"][0]["logprobs"] = [-0.1, -0.2, -0.3]
    assert submit(served, json.dumps(pack_group(plain)).encode()).json() == {"accepted": True}


def test_a_group_larger_than_a_batch_is_refused(served: Served) -> None:
    answer = submit(served, json.dumps(group("too-big", n=BATCH_SIZE + 1)).encode())
    assert answer.status_code == 422
    assert "group_size" in answer.text and f"batch_size {BATCH_SIZE}" in answer.text, answer.text
    assert submit(served, json.dumps(group("exactly-a-batch", n=BATCH_SIZE)).encode()).status_code == 200


def test_a_buffer_smaller_than_a_batch_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"queue\.capacity_seqs \(32\) is below queue\.batch_size \(64\)"):
        parse_config({"queue": {"batch_size": 64, "capacity_seqs": 32}})
    with pytest.raises(ConfigError, match=r"queue\.capacity_bytes .* queue\.max_group_bytes"):
        parse_config({"queue": {"capacity_bytes": 1000, "max_group_bytes": 2000}})


def test_a_store_failure_answers_503_with_retry_after(tmp_path: Path) -> None:
    served = Served(tmp_path)
    try:
        for i in range(BATCH_SIZE // 2):
            assert submit(served, json.dumps(group(f"before-{i}")).encode()).status_code == 200
        served.queue.store.close()  # the store is gone: no group can be made durable, no batch read
        answer = submit(served, json.dumps(group("after")).encode())
        assert answer.status_code == 503, answer.text
        assert int(answer.headers["retry-after"]) >= 1
        pulled = httpx.post(served.url + "/trainer/batch", headers=AUTH, timeout=30)
        assert pulled.status_code == 503 and int(pulled.headers["retry-after"]) >= 1, pulled.text
    finally:
        served.server.stop()


def test_the_sdk_resends_the_same_group_through_server_errors_and_a_full_buffer() -> None:
    from slurm_elastic.client.control import ControlClient

    answers = iter([httpx.Response(503, headers={"retry-after": "2"}, json={"detail": "store"}),
                    httpx.Response(502, text="bad gateway"), httpx.Response(504, text="timeout"),
                    httpx.Response(500, json={"detail": "oops"}),
                    httpx.Response(429, headers={"retry-after": "3"}, json={"detail": "full"}),
                    httpx.Response(200, json={"accepted": True})])
    seen: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.content)
        if len(seen) == 2:
            raise httpx.ConnectError("refused")
        return next(answers)

    pauses: list[float] = []
    client = ControlClient("http://controller", TOKEN, transport=httpx.MockTransport(handler))
    assert client.submit_group(group("resent"), sleep=pauses.append) == {"accepted": True}
    assert len(seen) == 7 and len(set(seen)) == 1  # the same body (the same group id) each time
    assert pauses[0] == 2.0 and pauses[-1] == 3.0  # Retry-After when given, a growing backoff otherwise
    assert pauses[1:4] == sorted(pauses[1:4])
    refused = ControlClient("http://controller", TOKEN,
                            transport=httpx.MockTransport(lambda _r: httpx.Response(422, json={"detail": "bad"})))
    with pytest.raises(Exception, match="422"):
        refused.submit_group(group("invalid"), sleep=pauses.append)
