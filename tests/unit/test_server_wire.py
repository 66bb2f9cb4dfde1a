"""What a server's registration and a router's load report may say: values that reach routers,
operators' terminals and Prometheus are checked at the edge (a hostile-client audit had escape
codes and a newline accepted as an endpoint, and routers' totals summed past 64-bit integers)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from slurm_elastic.client.wire import LoadReport, Registration


@pytest.mark.parametrize("endpoint", ["", "http://node1:8000", "https://10.0.0.7:443/v1", "http://[fe80::1]:9"])
def test_an_endpoint_is_an_http_url_or_nothing(endpoint: str) -> None:
    assert Registration(node="node1", endpoint=endpoint).endpoint == endpoint


@pytest.mark.parametrize("endpoint", ["javascript:alert(1)", "http://node1:8000\n", "http://n\x1b[31m:1",
                                      "http://user@evil:80", "node1:8000", "http:// node1"])
def test_anything_else_is_refused(endpoint: str) -> None:
    with pytest.raises(ValidationError):
        Registration(node="node1", endpoint=endpoint)


@pytest.mark.parametrize(("field", "value"), [("node", "node1\x1b[2J"), ("node", "a b"), ("step_id", "1\n")])
def test_a_node_or_step_id_with_other_characters_is_refused(field: str, value: str) -> None:
    with pytest.raises(ValidationError):
        Registration(**{"node": "node1", field: value})


def test_a_routers_totals_are_bounded_so_that_their_sum_stays_in_int64() -> None:
    assert LoadReport(client_id="r", sent=10**15).sent == 10**15
    with pytest.raises(ValidationError):
        LoadReport(client_id="r", sent=2**63 - 1)
    assert 256 * 10**15 < 2**63 - 1
