"""The compact wire form of a rollout sequence: token ids and loss mask as base64 bytes.

``tokens_b64`` is base64 of little-endian int32 token ids, ``mask_b64`` base64 of one byte (0 or
1) per token. The controller validates them without building a Python int per token, which is
what makes a submit cheap; the SDK sends this form by default and the trainer helper turns it
back into lists, so neither side's code sees the difference.
"""

from __future__ import annotations

import base64
import binascii
import string
import struct
import sys
from collections.abc import Sequence
from typing import Any

_MASK_VALUES = b"\x00\x01"


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


_ALPHABET = (string.ascii_uppercase + string.ascii_lowercase + string.digits + "+/").encode()


def _chars_with_bit_clear(bit: int) -> bytes:
    return bytes(c for value, c in enumerate(_ALPHABET) if not value & (1 << bit)) + b"="


# Base64 turns every 12 bytes (3 little-endian int32) into 16 characters. The sign bits of
# bytes 3, 7 and 11 (the high bytes) are bit 5 of character 4, bit 3 of character 9 and bit 1 of
# character 14 of each block: checking those characters finds a negative id without decoding.
_SIGN_BITS = ((4, _chars_with_bit_clear(5)), (9, _chars_with_bit_clear(3)), (14, _chars_with_bit_clear(1)))


def check_tokens_b64(text: str) -> int:
    """How many token ids ``text`` holds; ValueError naming the field if it is not well-formed
    (base64 of whole little-endian int32 values, none negative). Checked without decoding."""
    try:
        raw = text.encode("ascii")
    except UnicodeEncodeError:
        raise ValueError("tokens_b64 is not valid base64") from None
    body = raw.rstrip(b"=")
    if len(raw) % 4 or len(raw) - len(body) > 2 or body.translate(None, _ALPHABET):
        raise ValueError("tokens_b64 is not valid base64")
    n_bytes = decoded_length(text)
    if n_bytes % 4:
        raise ValueError(f"tokens_b64 holds {n_bytes} bytes, not a whole number of int32 values")
    for offset, clear in _SIGN_BITS:
        if raw[offset::16].translate(None, clear):
            raise ValueError("tokens_b64 holds a negative token id")
    return n_bytes // 4


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
