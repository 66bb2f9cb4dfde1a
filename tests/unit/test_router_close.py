"""A router closed while its threads talk to the controller ends them without an error: close()
closes the control client under a report or a discovery call in flight (seen once in CI as an
unhandled ``RuntimeError: Cannot send a request, as the client has been closed`` in the report
thread). The router's routing is tested against a live controller in tests/cluster/test_servers.py."""

from __future__ import annotations

from slurm_elastic.router import Router


def test_a_report_or_a_discovery_call_after_close_ends_quietly() -> None:
    router = Router("http://127.0.0.1:9", "token", report_interval_s=60.0, poll_wait_s=0.1)
    router.close()
    router.report_now()  # the report thread's call, after close() closed the client under it
    router._discover_loop()  # returns: stopped
    assert not any(t.is_alive() for t in router._threads)

