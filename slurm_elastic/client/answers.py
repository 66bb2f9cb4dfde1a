"""How a client reads the controller's answers (no HTTP here: the worker SDK imports it too)."""

from __future__ import annotations

from typing import Any

from slurm_elastic.core.defaults import LONGEST_HEARTBEAT_INTERVAL_S

ANSWER_MAX_BYTES = 64 << 20  # an answer of a control route: a few KiB (the status of thousands of workers: a few MiB)
ANSWER_MIN_BYTES_PER_S = 1 << 20  # past its timeout, an answer still arriving slower than this is given up


def answer_deadline_s(timeout_s: float, received_bytes: int) -> float:
    """How long after its head an answer may take to arrive with ``received_bytes`` of it in:
    the call's timeout, plus a second for each ANSWER_MIN_BYTES_PER_S received."""
    return timeout_s + received_bytes / ANSWER_MIN_BYTES_PER_S


def stored_by_an_earlier_try(answer: dict[str, Any]) -> dict[str, Any]:
    """A submit's answer after a try of it that may have reached the controller failed: "a retry
    of a group stored before" means that try stored it."""
    if answer.get("accepted") is False and "reason" not in answer:
        return {"accepted": True, "resent": True}
    return answer


def paced_interval_s(answer: dict[str, Any], current_s: float) -> float:
    """The heartbeat interval a registration's or heartbeat's answer asks for (the controller paces
    a large pool: ``workers.max_heartbeats_per_s``); ``current_s`` for an answer without one (an
    older controller) or with one that is not a number of seconds in (0, 3600]."""
    value = answer.get("heartbeat_interval_s")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= LONGEST_HEARTBEAT_INTERVAL_S:
        return current_s
    return float(value)
