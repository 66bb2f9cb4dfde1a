"""The compact wire form of a rollout sequence: token ids and loss mask as base64 bytes.

``tokens_b64`` is base64 of little-endian int32 token ids, ``mask_b64`` base64 of one byte (0 or
1) per token. The controller validates them without building a Python int per token, which is
what makes a submit cheap; the SDK sends this form by default and the trainer helper turns it
back into lists, so neither side's code sees the difference.
"""

from __future__ import annotations

import base64
import binascii
import struct
import sys
from collections.abc import Sequence
from typing import Any

_MASK_VALUES = b"\x00\x01"
_NON_NEGATIVE_HIGH_BYTES = bytes(range(0x80))


def encode_tokens(tokens: Sequence[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(tokens)}i", *tokens)).decode()


def decode_tokens(text: str) -> list[int]:
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def encode_mask(mask: Sequence[int]) -> str:
    return base64.b64encode(bytes(mask)).decode()


def decode_mask(text: str) -> list[int]:
    return list(base64.b64decode(text))


def _decode_strict(text: str, field: str) -> bytes:
    try:
        if sys.version_info >= (3, 11):
            return binascii.a2b_base64(text, strict_mode=True)  # C; no regex pass over the text
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field} is not valid base64") from None


def check_tokens_b64(text: str) -> int:
    """How many token ids ``text`` holds; ValueError naming the field if it is not well-formed."""
    raw = _decode_strict(text, "tokens_b64")
    if len(raw) % 4:
        raise ValueError(f"tokens_b64 holds {len(raw)} bytes, not a whole number of int32 values")
    if raw[3::4].translate(None, _NON_NEGATIVE_HIGH_BYTES):  # a high byte >= 0x80: a negative id
        raise ValueError("tokens_b64 holds a negative token id")
    return len(raw) // 4


def check_mask_b64(text: str) -> int:
    """How many mask values ``text`` holds; ValueError naming the field unless every byte is 0 or 1."""
    raw = _decode_strict(text, "mask_b64")
    if raw.translate(None, _MASK_VALUES):
        raise ValueError("mask_b64 holds a byte other than 0 or 1")
    return len(raw)


def decoded_length(text: str) -> int:
    """Bytes in well-formed base64 ``text``, without decoding it."""
    return len(text) // 4 * 3 - text.endswith("=") - text.endswith("==")


def pack_group(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` with each sequence's ``tokens`` and ``mask`` lists in the compact form."""
    sequences = []
    for seq in group.get("sequences", []):
        packed = dict(seq)
        if "tokens" in packed and packed["tokens"] is not None:
            packed["tokens_b64"] = encode_tokens(packed.pop("tokens"))
        if "mask" in packed and packed["mask"] is not None:
            packed["mask_b64"] = encode_mask(packed.pop("mask"))
        sequences.append(packed)
    return {**group, "sequences": sequences} if "sequences" in group else dict(group)


def unpack_group(group: dict[str, Any]) -> dict[str, Any]:
    """The reverse of :func:`pack_group`: ``tokens`` and ``mask`` as lists of ints again."""
    for seq in group.get("sequences", []):
        if "tokens_b64" in seq:
            seq["tokens"] = decode_tokens(seq.pop("tokens_b64"))
        if "mask_b64" in seq:
            seq["mask"] = decode_mask(seq.pop("mask_b64"))
    return group
