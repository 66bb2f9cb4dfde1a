"""The compact wire form (tokens_b64, mask_b64): round trip, and the submit route's checks on it."""

from __future__ import annotations

import base64
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from slurm_elastic.controller.rollout_http import RolloutGroup
from slurm_elastic.rollouts.wire import check_tokens_b64, decoded_length, pack_group, unpack_group


def group(**seq: object) -> dict[str, object]:
    return {"id": "g", "worker_id": "0001", "policy_version": 0, "group_size": 1,
            "sequences": [{"score": 0.5, **seq}]}


def test_pack_and_unpack_round_trip() -> None:
    plain = group(tokens=[0, 7, 2**31 - 1], mask=[0, 1, 1], logprobs=[-0.5, -1.0, -2.0])
    packed = pack_group(plain)
    assert set(packed["sequences"][0]) == {"tokens_b64", "mask_b64", "score", "logprobs"}
    RolloutGroup.model_validate(packed)
    assert unpack_group(packed) == plain


def test_decoded_length_matches_base64() -> None:
    for n in range(12):
        assert decoded_length(base64.b64encode(b"x" * n).decode()) == n


@pytest.mark.parametrize(("seq", "named"), [
    ({"tokens_b64": "not base64!"}, "tokens_b64 is not valid base64"),
    ({"tokens_b64": base64.b64encode(b"abc").decode()}, "whole number of int32"),
    ({"tokens_b64": base64.b64encode(struct.pack("<2i", 5, -1)).decode()}, "negative token id"),
    ({"tokens": [1, 2], "mask_b64": base64.b64encode(b"\x01\x02").decode()}, "mask_b64 holds a byte"),
    ({"tokens": [1, 2], "mask_b64": base64.b64encode(b"\x01").decode()}, "mask has 1 values for 2 tokens"),
    ({"tokens": [1, 2], "mask": [1, 1], "mask_b64": base64.b64encode(b"\x01\x01").decode()}, "at most one of mask"),
])
def test_malformed_compact_fields_are_refused_by_name(seq: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError) as refused:
        RolloutGroup.model_validate(group(**seq))
    assert named in str(refused.value)


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40))
def test_negative_ids_are_found_without_decoding(ids: list[int]) -> None:
    text = base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode()
    if any(i < 0 for i in ids):
        with pytest.raises(ValueError, match="negative"):
            check_tokens_b64(text)
    else:
        assert check_tokens_b64(text) == len(ids)


@given(st.binary(min_size=1, max_size=64))
def test_malformed_base64_is_refused_like_a_strict_decoder(raw: bytes) -> None:
    text = base64.b64encode(raw).decode()
    for broken in (text[:-1], text + "=", "!" + text[1:], text.replace("=", "A=A") if "=" in text else text + "*"):
        with pytest.raises(ValueError):
            check_tokens_b64(broken)
