"""The compact wire form (tokens_b64, mask_b64): round trip, and the submit route's checks on it."""

from __future__ import annotations

import base64
import json
import re
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from slurm_elastic.controller.submit import RolloutGroup
from slurm_elastic.rollouts.wire import (
    check_token_ids,
    decode_tokens,
    group_json,
    pack_group,
    unpack_group,
)


def group(**seq: object) -> dict[str, object]:
    return {"id": "g", "worker_id": "0001", "policy_version": 0, "group_size": 1,
            "sequences": [{"score": 0.5, **seq}]}


def validate(body: dict[str, object]) -> RolloutGroup:
    """As the route validates: from the JSON text (which is what decodes the compact fields)."""
    return RolloutGroup.model_validate_json(json.dumps(body))


def test_pack_and_unpack_round_trip() -> None:
    plain = group(tokens=[0, 7, 2**31 - 1], mask=[0, 1, 1], logprobs=[-0.5, -1.0, -2.0])
    packed = pack_group(plain)
    assert set(packed["sequences"][0]) == {"tokens_b64", "mask_b64", "score", "logprobs"}
    checked = validate(packed)
    assert checked.sequences[0].tokens_b64 == struct.pack("<3i", 0, 7, 2**31 - 1)
    assert unpack_group(packed) == plain


@pytest.mark.parametrize(("seq", "named"), [
    ({"tokens_b64": "not base64!"}, "sequences.0.tokens_b64\n  Data should be valid base64"),
    ({"tokens_b64": "AAEC-/=="}, "sequences.0.tokens_b64\n  Data should be valid base64"),  # mixed alphabets
    ({"tokens_b64": base64.b64encode(b"abc").decode()}, "sequences[0].tokens_b64 is not whole non-negative"),
    ({"tokens_b64": base64.b64encode(struct.pack("<2i", 5, -1)).decode()}, "sequences[0].tokens_b64 is not whole"),
    ({"tokens": [1, 2], "mask_b64": base64.b64encode(b"\x01\x02").decode()}, "sequences[0].mask_b64 holds a byte"),
    ({"tokens": [1, 2], "mask_b64": base64.b64encode(b"\x01").decode()}, "the mask has 1 values for 2 tokens"),
    ({"tokens": [1, 2], "mask": [1, 1], "mask_b64": base64.b64encode(b"\x01\x01").decode()}, "at most one of mask"),
    ({"tokens": [1], "tokens_b64": base64.b64encode(b"\x01\0\0\0").decode()}, "exactly one of tokens"),
    ({"mask": [1]}, "exactly one of tokens"),
])
def test_malformed_compact_fields_are_refused_by_name(seq: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError) as refused:
        validate(group(**seq))
    assert named in str(refused.value)


def test_the_bad_sequence_is_named_in_a_group() -> None:
    good = {"score": 0.5, "tokens_b64": base64.b64encode(struct.pack("<2i", 1, 2)).decode(),
            "mask_b64": base64.b64encode(b"\x01\x00").decode()}
    sequences = [dict(good) for _ in range(5)]
    sequences[3]["tokens_b64"] = base64.b64encode(struct.pack("<2i", 1, -2)).decode()
    sequences[4]["mask_b64"] = base64.b64encode(b"\x01\x07").decode()
    body = {**group(), "group_size": 5, "sequences": sequences}
    with pytest.raises(ValidationError, match=r"sequences\[3\]\.tokens_b64 is not whole"):
        validate(body)
    sequences[3] = dict(good)
    with pytest.raises(ValidationError, match=r"sequences\[4\]\.mask_b64 holds a byte"):
        validate(body)
    sequences[4] = dict(good)
    validate(body)


@given(st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=12), min_size=1, max_size=5))
def test_negative_ids_are_found_in_the_group(groups: list[list[int]]) -> None:
    decoded = [struct.pack(f"<{len(ids)}i", *ids) for ids in groups]
    first_bad = next((i for i, ids in enumerate(groups) if any(t < 0 for t in ids)), None)
    assert check_token_ids(decoded) == first_bad


@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12))
def test_either_alphabet_with_or_without_padding_is_accepted_and_decodes_the_same(ids: list[int]) -> None:
    raw = struct.pack(f"<{len(ids)}i", *ids)
    standard, url_safe = base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()
    for text in (standard, standard.rstrip("="), url_safe, url_safe.rstrip("=")):
        assert validate(group(tokens_b64=text)).sequences[0].tokens_b64 == raw
        assert decode_tokens(text) == ids


@given(st.binary(min_size=1, max_size=64))
def test_malformed_base64_is_refused(raw: bytes) -> None:
    text = base64.b64encode(raw).decode()
    for broken in ("!" + text[1:], text + "*", text + "A=A", text[:2] + " " + text[2:]):
        with pytest.raises(ValidationError, match="tokens_b64"):
            validate(group(tokens_b64=broken))


@pytest.mark.parametrize(("seq", "said"), [
    ({"tokens": [1, 2**31]}, "sequences[0].tokens: [1] is 2147483648"),
    ({"tokens": [3, -1]}, "sequences[0].tokens: [1] is -1"),
    ({"mask": [0, 256]}, "sequences[0].mask: [1] is 256"),
    ({"mask": [0.5]}, "sequences[0].mask: [0] is 0.5"),
    ({"tokens": "abc"}, "sequences[0].tokens: a list, not str"),
])
def test_a_value_the_compact_form_cannot_hold_is_named(seq: dict[str, object], said: str) -> None:
    with pytest.raises(ValueError, match=re.escape(said)):
        pack_group({"sequences": [seq]})


def test_numpy_values_go_as_plain_ones_and_a_value_json_cannot_hold_is_named() -> None:
    np = pytest.importorskip("numpy")
    group = {"id": "g", "sequences": [{"tokens": np.array([5, 6], dtype=np.int64), "mask": np.array([0, 1]),
                                       "score": np.float32(0.5), "logprobs": np.array([-0.5, -1.25])}],
             "metadata": {"reward": np.float64(1.5)}}
    sent = group_json(pack_group({**group, "worker_id": "0001", "policy_version": 0, "group_size": 1}))
    RolloutGroup.model_validate_json(sent)  # what the route takes
    seq = json.loads(sent)["sequences"][0]
    assert seq["score"] == 0.5 and seq["logprobs"] == [-0.5, -1.25] and json.loads(sent)["metadata"] == {"reward": 1.5}
    assert unpack_group(json.loads(sent))["sequences"][0]["tokens"] == [5, 6]
    with pytest.raises(ValueError, match="rollout group 'g' cannot be sent as JSON: a value of type object"):
        group_json({"id": "g", "sequences": [{"score": object()}]})
