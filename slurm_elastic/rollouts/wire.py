"""The compact wire form of a rollout sequence: token ids and loss mask as base64 bytes.

``tokens_b64`` is base64 of little-endian int32 token ids, ``mask_b64`` base64 of one byte (0 or
1) per token. Either base64 alphabet is accepted (standard or URL-safe, not mixed in one field),
padding optional. pydantic-core decodes them (in Rust) while it parses the request, and the
route checks the decoded bytes of a whole group at once (:func:`check_token_ids`,
:func:`check_mask_values`), so no Python int is built per token: that is what makes a submit
cheap. The SDK sends this form by default and the trainer helper turns it back into lists, so
neither side's code sees the difference.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Sequence
from typing import Any

_MASK_VALUES = b"\x00\x01"
_NON_NEGATIVE_HIGH_BYTES = bytes(range(128))  # the high byte of a little-endian int32 >= 0
_URL_SAFE_TO_STANDARD = str.maketrans("-_", "+/")


def encode_tokens(tokens: Sequence[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(tokens)}i", *tokens)).decode()


def decode_tokens(text: str) -> list[int]:
    raw = _b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def encode_mask(mask: Sequence[int]) -> str:
    return base64.b64encode(bytes(mask)).decode()


def decode_mask(text: str) -> list[int]:
    return list(_b64decode(text))


def _b64decode(text: str) -> bytes:
    """Base64 as the route accepts it: either alphabet, padding optional."""
    return base64.b64decode(text.translate(_URL_SAFE_TO_STANDARD) + "=" * (-len(text) % 4), validate=True)


def check_token_ids(decoded: Sequence[bytes]) -> int | None:
    """The index in ``decoded`` of the first field that is not whole non-negative little-endian
    int32 values, or None. One pass over the group's high bytes when all are well-formed."""
    if not any(len(raw) % 4 for raw in decoded) and not b"".join(decoded)[3::4].translate(
            None, _NON_NEGATIVE_HIGH_BYTES):
        return None
    return next(i for i, raw in enumerate(decoded)
                if len(raw) % 4 or raw[3::4].translate(None, _NON_NEGATIVE_HIGH_BYTES))


def check_mask_values(decoded: Sequence[bytes]) -> int | None:
    """The index in ``decoded`` of the first mask holding a byte other than 0 or 1, or None."""
    if not b"".join(decoded).translate(None, _MASK_VALUES):
        return None
    return next(i for i, raw in enumerate(decoded) if raw.translate(None, _MASK_VALUES))


def pack_group(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` with each sequence's ``tokens`` and ``mask`` lists in the compact form (a numpy
    array or torch tensor is taken as its ``tolist()``). A value neither form holds raises
    ValueError naming it (``sequences[2].tokens: [5] is -1``)."""
    sequences = []
    for i, seq in enumerate(group.get("sequences", [])):
        packed = dict(seq)
        for key, encode, valid in (("tokens", encode_tokens, "whole numbers from 0 to 2**31 - 1"),
                                   ("mask", encode_mask, "0 or 1")):
            if key in packed and packed[key] is not None:
                values = packed.pop(key)
                values = values.tolist() if hasattr(values, "tolist") else values
                try:
                    packed[f"{key}_b64"] = encode(values)
                    if key == "tokens" and values and min(values) < 0:  # int32 holds them; no token id is
                        raise ValueError
                except (struct.error, ValueError, TypeError, OverflowError):
                    raise ValueError(f"sequences[{i}].{key}: {_first_bad(values, key)}; each must be {valid}") from None
        sequences.append(packed)
    return {**group, "sequences": sequences} if "sequences" in group else dict(group)


def group_json(group: dict[str, Any]) -> bytes:
    """``group`` as the JSON a submit sends; numpy and torch scalars and arrays (a ``score`` of
    ``np.float32``) go as their ``tolist()``. A value JSON cannot hold raises ValueError naming
    its type."""
    try:
        return json.dumps(group, separators=(",", ":"), default=_plain).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"rollout group {group.get('id')!r} cannot be sent as JSON: {exc}") from None


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"a value of type {type(value).__name__} is not a JSON number, string, list or object")


def _first_bad(values: Any, key: str) -> str:
    """Which value of a ``tokens`` or ``mask`` list the compact form cannot hold."""
    top = 2**31 if key == "tokens" else 2
    if not isinstance(values, (list, tuple)):
        return f"a list, not {type(values).__name__}"
    for j, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < top:
            return f"[{j}] is {value!r}"
    return "a value is out of range"


def unpack_group(group: dict[str, Any]) -> dict[str, Any]:
    """The reverse of :func:`pack_group`: ``tokens`` and ``mask`` as lists of ints again."""
    for seq in group.get("sequences", []):
        if "tokens_b64" in seq:
            seq["tokens"] = decode_tokens(seq.pop("tokens_b64"))
        if "mask_b64" in seq:
            seq["mask"] = decode_mask(seq.pop("mask_b64"))
    return group
