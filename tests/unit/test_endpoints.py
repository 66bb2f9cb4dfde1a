"""The endpoint book: versions, load reports and their expiry."""

from __future__ import annotations

from slurm_elastic.core.endpoints import Endpoint, EndpointBook

A = Endpoint("0001", "http://n1:1", "node1", (0,))
B = Endpoint("0002", "http://n2:2", "node2", (1,))


def test_versions_move_only_on_change() -> None:
    book = EndpointBook(version=100)
    assert book.publish([A]) and book.version == 101
    assert not book.publish([A]) and book.version == 101
    assert book.publish([A, B]) and book.version == 102


def test_load_sums_fresh_reports_and_forgets_old_ones() -> None:
    book = EndpointBook(report_ttl_s=10)
    book.publish([A, B])
    book.report("r1", {"0001": 3, "0002": 1}, now_s=0)
    book.report("r2", {"0001": 2}, now_s=5)
    assert book.outstanding("0001", 6) == 5 and book.total_outstanding(6) == 6
    assert book.load_ratio(capacity_per_server=4, now_s=6) == 6 / 8
    assert book.outstanding("0001", 12) == 2  # r1's report expired
    assert book.view(12)["routers"] == 1


def test_no_servers_no_ratio() -> None:
    assert EndpointBook().load_ratio(8, 0) is None
