"""How a client reads the controller's answers (no HTTP here: the worker SDK imports it too)."""

from __future__ import annotations

from typing import Any


def stored_by_an_earlier_try(answer: dict[str, Any]) -> dict[str, Any]:
    """A submit's answer after a try of it that may have reached the controller failed: "a retry
    of a group stored before" means that try stored it."""
    if answer.get("accepted") is False and "reason" not in answer:
        return {"accepted": True, "resent": True}
    return answer
