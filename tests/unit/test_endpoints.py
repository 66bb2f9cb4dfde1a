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


def test_reports_are_pruned_by_age_and_capped_on_every_report() -> None:
    book = EndpointBook(report_ttl_s=10, max_clients=3)
    for i in range(10):
        book.report(f"r{i}", {"0001": 1}, now_s=float(i))
    assert book.view(9.0)["routers"] == 3  # the newest three: r7, r8, r9
    assert book.outstanding("0001", 9.0) == 3
    book.report("r7", {"0001": 1}, now_s=9.5)  # a router reporting again counts as new
    book.report("late", {}, now_s=19.0)  # r8 (8.0) is now over 10 s old; r9, r7 and late stay
    assert book.view(19.0)["routers"] == 3 and book.outstanding("0001", 19.0) == 2


def test_prune_reports_keeps_what_is_fresh_and_within_the_cap() -> None:
    book = EndpointBook(report_ttl_s=5, max_clients=100)
    for i in range(20):
        book.report(f"r{i}", {}, now_s=float(i))
    assert book.view(19.0)["routers"] == 6  # 14..19: at most 5 s old


def test_the_request_totals_keep_what_routers_that_went_away_sent_and_count_each_request_once() -> None:
    """Found by a live audit: a router that ended took its totals out of status 10 s later
    (`2 routers: 1427 sent` became `1 router: 1138 sent` while the other kept sending), and one
    that failed requests and exited read as 0 failed."""
    book = EndpointBook(report_ttl_s=10.0, max_clients=2)
    book.report("a", {}, 0.0, sent=100, retried=5, failed=2)
    book.report("b", {}, 0.0, sent=50)
    book.report("b", {}, 15.0, sent=60)  # a went away
    view = book.view(15.0)
    assert view["routers"] == 1 and (view["requests_sent"], view["requests_retried"], view["requests_failed"]) == (
        160, 5, 2)
    book.report("a", {}, 16.0, sent=120, retried=5, failed=2)  # back: only what it sent since counts
    assert book.totals() == (180, 5, 2)
    for rounds in range(10):  # more routers than reports are kept, reporting round after round
        for n in range(600):
            book.report(f"r{n}", {}, 100.0 + rounds, sent=10 * (rounds + 1))
    assert book.totals() == (180 + 600 * 100, 5, 2)
    book.report("b", {}, 200.0, sent=3)  # totals that went down: a new router process under that id
    assert book.totals() == (183 + 600 * 100, 5, 2)
