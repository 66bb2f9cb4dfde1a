"""A router closed while its threads talk to the controller ends them without an error: close()
closes the control client under a report or a discovery call in flight (seen once in CI as an
unhandled ``RuntimeError: Cannot send a request, as the client has been closed`` in the report
thread). The router's routing is tested against a live controller in tests/cluster/test_servers.py."""

from __future__ import annotations

import pytest

from slurm_elastic.router import Router, RoutingError


def test_a_report_or_a_discovery_call_after_close_ends_quietly() -> None:
    router = Router("http://127.0.0.1:9", "token", report_interval_s=60.0, poll_wait_s=0.1)
    router.close()
    router.report_now()  # the report thread's call, after close() closed the client under it
    router._discover_loop()  # returns: stopped
    assert not any(t.is_alive() for t in router._threads)



def test_a_report_under_a_client_swapped_for_a_moved_controller_keeps_the_report_thread_alive() -> None:
    """Discovery follows a restarted controller to its new port by closing the old client: a
    report in flight on it then met "client has been closed", which ended the report thread
    for good (the new controller never heard of the router's load)."""
    router = Router("http://127.0.0.1:9", "token", report_interval_s=60.0, poll_wait_s=0.1)
    try:
        router._control.close()  # as _follow_controller does, under a report
        router.report_now()
    finally:
        router.close()


def test_a_request_sent_while_the_router_knows_no_server_fails_after_waiting_for_one() -> None:
    router = Router("http://127.0.0.1:9", "token", report_interval_s=60.0, poll_wait_s=0.1, wait_for_server_s=0.2)
    try:
        with pytest.raises(RoutingError, match=r"no routable server after waiting 0.2 s \(wait_for_server_s\)"):
            router.request("GET", "/health")
    finally:
        router.close()
