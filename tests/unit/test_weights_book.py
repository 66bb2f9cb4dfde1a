"""The pure bookkeeping of weights following the trainer: who runs what, who is due an update,
who failed and how often, who may be in discovery."""

from __future__ import annotations

from slurm_elastic.core.endpoints import Endpoint, EndpointBook
from slurm_elastic.core.weights import SavedUpdates, ServerWeights, WeightsBook
from slurm_elastic.worker.wrapper import launch_with_weights


def servers(*loaded: int | None) -> list[ServerWeights]:
    return [ServerWeights(f"000{i + 1}", f"http://n:{i}", v) for i, v in enumerate(loaded)]


def test_nothing_is_due_before_a_publish_and_every_server_is_routable() -> None:
    book = WeightsBook()
    assert book.due(servers(None, None), 0.0) == []
    assert book.routable("0001", None) and book.view() is None


def test_a_publish_is_due_to_every_server_on_another_version_once() -> None:
    book = WeightsBook()
    book.publish(3, "/ckpt/3")
    orders = book.due(servers(None, 2, 3), 0.0)
    assert [(o.worker_id, o.weights.version, o.weights.ref, o.attempt) for o in orders] == [
        ("0001", 3, "/ckpt/3", 1), ("0002", 3, "/ckpt/3", 1)]
    assert book.due(servers(None, 2, 3), 1.0) == []  # in flight: not sent twice
    assert book.server_view("0001")["weights_updating_to"] == 3


def test_a_version_published_again_with_other_weights_is_a_conflict() -> None:
    """A server counts as up to date by its version alone: version 3 published again at another
    ref would never reach the servers at 3 (a hostile-client audit saw it accepted and not pushed)."""
    book = WeightsBook()
    assert book.conflict(3, "/ckpt/3") is None  # nothing published yet
    book.publish(3, "/ckpt/3")
    assert book.conflict(3, "/ckpt/3") is None and book.conflict(4, "/ckpt/other") is None  # a retry; a new version
    assert "version 3 was published with the weights at '/ckpt/3'" in (book.conflict(3, "/ckpt/other") or "")


def test_a_new_server_enters_discovery_only_at_the_latest_version() -> None:
    book = WeightsBook()
    book.due([], 0.0)  # the first round has passed (nothing to adopt)
    book.publish(3, "/ckpt/3")
    assert not book.routable("0001", None) and not book.routable("0001", 2)
    assert len(book.due(servers(2), 0.0)) == 1
    assert not book.routable("0001", 2)  # its update is under way: still out
    assert book.done("0001", 3, "", 1.0).action == "loaded"
    assert book.routable("0001", 3)


def test_a_joined_server_stays_routable_while_it_updates_to_the_next_version() -> None:
    book = WeightsBook()
    book.publish(3, "/ckpt/3")
    book.due(servers(3), 0.0)  # at the latest: joined
    book.publish(4, "/ckpt/4")
    [order] = book.due(servers(3), 1.0)
    assert order.weights.version == 4 and book.routable("0001", 3)


def test_a_failed_update_leaves_discovery_at_once_is_retried_after_a_backoff_then_replaced() -> None:
    book = WeightsBook(max_failures=3, retry_backoff_s=2.0)
    book.publish(3, "/ckpt/3")
    book.due(servers(3, 3), 0.0)  # both joined
    book.publish(4, "/ckpt/4")
    book.due(servers(3, 3), 0.0)
    assert book.done("0002", 4, "", 0.0).action == "loaded"  # the weights are good: 0001's failures are its own
    first = book.done("0001", 4, "HTTP 400: corrupt", 0.0)
    assert first.action == "retry" and "(1/3)" in first.reason
    assert not book.routable("0001", 3) and book.routable("0002", 4)
    assert book.due(servers(3, 4), 1.9) == []  # backing off 2 s
    [again] = book.due(servers(3, 4), 2.0)
    assert again.attempt == 2
    assert book.done("0001", 4, "HTTP 400: corrupt", 2.0).action == "retry"
    assert book.due(servers(3, 4), 5.9) == [] and len(book.due(servers(3, 4), 6.0)) == 1  # doubled: 4 s
    last = book.done("0001", 4, "no answer within 5 s", 6.0)
    assert last.action == "replace"
    assert last.reason == "weights update to version 4 failed 3 times in a row: no answer within 5 s"
    assert book.due(servers(3, 4), 100.0) == []  # replaced, not retried
    assert book.server_view("0001")["weights_update_failures"] == 3


def test_weights_every_server_fails_take_no_server_out_of_discovery_and_replace_none() -> None:
    """Found by a live audit: one publish every server failed (a mistyped path) took the whole
    fleet out of discovery at once, and replaced it again and again, each round a model load."""
    book = WeightsBook(max_failures=2, retry_backoff_s=1.0)
    book.publish(3, "/ckpt/3")
    book.due(servers(3, 3), 0.0)
    book.publish(4, "/ckpt/typo")
    assert len(book.due(servers(3, 3), 0.0)) == 2
    outcomes = [book.done(w, 4, "HTTP 500: no such file", 0.0) for w in ("0001", "0002")]
    assert [o.action for o in outcomes] == ["retry", "retry"]
    assert book.routable("0001", 3) and book.routable("0002", 3)  # still serving version 3
    assert len(book.due(servers(3, 3), 1.0)) == 2
    last = book.done("0001", 4, "HTTP 500: no such file", 1.0)
    assert last.action == "retry" and "no server has loaded it: kept in discovery" in last.reason
    assert book.routable("0001", 3)
    book.publish(5, "/ckpt/5")  # the fixed path: tried at once, counted afresh
    assert [o.attempt for o in book.due(servers(3, 3), 1.5)] == [1]  # 0002's update to 4 is still in flight
    assert book.done("0002", 4, "HTTP 500: no such file", 1.6).reason.endswith("version 5 is due next")
    assert [o.worker_id for o in book.due(servers(3, 3), 1.7)] == ["0002"]  # a superseded failure: no backoff


def test_a_server_started_after_weights_no_server_loads_is_given_the_weights_the_fleet_runs() -> None:
    """Found by a live audit: after a publish every server failed, a server relaunched since (on
    its base model) failed it too and stayed ACTIVE out of discovery for good, holding its GPU and
    a place in the target: each crash or replacement lost one more server."""
    book = WeightsBook(max_failures=2, retry_backoff_s=1.0)
    book.publish(8, "/ckpt/8")
    book.due(servers(None, None), 0.0)
    assert [book.done(w, 8, "", 0.0).action for w in ("0001", "0002")] == ["loaded", "loaded"]
    book.publish(9, "/ckpt/bad")
    fleet = [ServerWeights("0001", "u1", 8), ServerWeights("0003", "u3", None)]  # 0003: relaunched since
    for now_s in (1.0, 3.0):
        assert {o.worker_id for o in book.due(fleet, now_s)} == {"0001", "0003"}
        assert {book.done(w, 9, "HTTP 400", now_s).action for w in ("0001", "0003")} == {"retry"}
    assert book.routable("0001", 8) and not book.routable("0003", None)
    [order] = book.due(fleet, 10.0)  # 0003 gave up on 9: it gets 8, what 0001 runs; 0001 is left alone
    assert (order.worker_id, order.weights.version, order.weights.ref) == ("0003", 8, "/ckpt/8")
    assert book.done("0003", 8, "", 10.5).action == "loaded"
    fleet[1] = ServerWeights("0003", "u3", 8)
    assert book.routable("0003", 8) and book.due(fleet, 20.0) == []  # in discovery, on the fleet's weights
    book.publish(10, "/ckpt/10")  # a good publish: everyone tries it afresh
    assert {o.worker_id for o in book.due(fleet, 21.0)} == {"0001", "0003"}
    assert book.fallback is not None and book.done("0001", 10, "", 21.5).action == "loaded"
    assert book.fallback is None


def test_a_server_that_cannot_load_the_fleets_weights_either_is_replaced() -> None:
    book = WeightsBook(max_failures=1, retry_backoff_s=1.0)
    book.publish(8, "/ckpt/8")
    book.due([ServerWeights("0001", "u1", None)], 0.0)
    book.done("0001", 8, "", 0.0)
    book.publish(9, "/ckpt/bad")
    fleet = [ServerWeights("0001", "u1", 8), ServerWeights("0002", "u2", None)]
    book.due(fleet, 1.0)
    book.done("0001", 9, "HTTP 400", 1.0)
    book.done("0002", 9, "HTTP 400", 1.0)
    [order] = book.due(fleet, 5.0)
    assert order.weights.version == 8
    outcome = book.done("0002", 8, "HTTP 400: out of memory", 5.0)
    assert outcome.action == "replace" and "which the other servers run, failed too" in outcome.reason


def test_a_failed_update_to_a_version_just_superseded_is_retried_not_replaced() -> None:
    """The fallback is the version just superseded: an ordinary update to it, failing after the
    next publish, read as a fallback order that failed, and its server was replaced (a code review)."""
    book = WeightsBook(max_failures=3, retry_backoff_s=1.0)
    book.publish(1, "/ckpt/1")
    book.due([ServerWeights("a", "ua", None), ServerWeights("s", "us", None)], 0.0)
    book.done("a", 1, "", 0.1)  # proven
    book.publish(2, "/ckpt/2")  # s's update to 1 still in flight
    assert book.done("s", 1, "timeout", 0.2).action == "retry"


def test_a_publish_back_to_an_earlier_version_keeps_no_newer_fallback() -> None:
    book = WeightsBook()
    book.publish(7, "/ckpt/7")
    book.due([ServerWeights("a", "ua", None)], 0.0)
    book.done("a", 7, "", 0.1)
    book.publish(5, "/ckpt/5")  # recovered from a checkpoint at 5: 7's weights are not the fleet's to come
    assert book.fallback is None


def test_a_server_that_gave_up_on_weights_no_server_had_loaded_tries_once_more_when_one_does() -> None:
    book = WeightsBook(max_failures=2, retry_backoff_s=1.0)
    book.publish(1, "/ckpt/1")
    book.due(servers(None, None), 0.0)
    book.done("0001", 1, "HTTP 400", 0.0)
    book.due(servers(None, None), 1.0)
    assert "no server has loaded it" in book.done("0001", 1, "HTTP 400", 1.0).reason
    assert book.done("0002", 1, "", 1.5).action == "loaded"  # the weights are good after all
    assert not book.routable("0001", None)
    [order] = book.due(servers(None, 1), 2.0)
    assert order.worker_id == "0001" and order.attempt == 2
    assert book.done("0001", 1, "HTTP 400", 2.5).action == "replace"


def test_a_success_clears_the_failures_and_a_new_publish_ends_a_backoff() -> None:
    book = WeightsBook(retry_backoff_s=60.0)
    book.publish(1, "/a")
    book.due(servers(None), 0.0)
    book.done("0001", 1, "boom", 0.0)
    book.publish(2, "/b")
    [order] = book.due(servers(None), 1.0)  # new weights: tried at once, its failures counted afresh
    assert order.weights.version == 2 and order.attempt == 1
    assert book.done("0001", 2, "", 2.0).action == "loaded"
    assert book.routable("0001", 2) and book.server_view("0001")["weights_update_failures"] == 0


def test_servers_gone_are_forgotten_and_a_restart_keeps_servers_at_a_published_version_routable() -> None:
    book = WeightsBook()
    book.publish(5, "/ckpt/5")  # restored from the record; servers restored with their versions
    orders = book.due(servers(4, None), 0.0)
    assert book.routable("0001", 4) and not book.routable("0002", None)  # 0001 was in discovery before
    assert {o.worker_id for o in orders} == {"0001", "0002"}
    book.due([], 1.0)
    assert book.server_view("0001")["weights_updating_to"] is None  # forgotten


def test_servers_a_restarted_controller_had_in_discovery_stay_in_while_their_update_runs() -> None:
    before = WeightsBook()
    before.due(servers(None, None), 0.0)  # both in discovery on the weights they started with
    before.publish(1, "/ckpt/1")
    before.due(servers(None, None), 1.0)
    after = WeightsBook()  # restarted: the record gives the weights, the state the servers in discovery
    after.publish(1, "/ckpt/1")
    after.rejoin(before.joined())
    assert {o.worker_id for o in after.due(servers(None, None, None), 2.0)} == {"0001", "0002", "0003"}
    assert after.routable("0001", None) and after.routable("0002", None)
    assert not after.routable("0003", None)  # a server that had not joined still waits for the weights


def test_without_an_update_hook_versions_are_kept_but_never_pushed_or_enforced() -> None:
    book = WeightsBook(enforced=False)
    book.publish(2, "/ckpt/2")
    assert book.due(servers(None), 0.0) == [] and book.routable("0001", None)
    assert book.view() == {"version": 2, "ref": "/ckpt/2", "enforced": False}


def test_discovery_can_list_only_servers_at_the_latest_weights_and_a_version_change_is_a_new_set() -> None:
    endpoints = EndpointBook()
    assert endpoints.publish([Endpoint("0001", "u1", "n", (0,), 3), Endpoint("0002", "u2", "n", (1,), 4)], 4)
    before = endpoints.version
    assert [e["worker_id"] for e in endpoints.view(0.0, latest_weights_only=True)["endpoints"]] == ["0002"]
    view = endpoints.view(0.0)
    assert view["weights_version"] == 4 and [e["weights_version"] for e in view["endpoints"]] == [3, 4]
    assert endpoints.publish([Endpoint("0001", "u1", "n", (0,), 4), Endpoint("0002", "u2", "n", (1,), 4)], 4)
    assert endpoints.version == before + 1


def test_the_wrapper_starts_an_engine_on_the_latest_weights_when_its_command_names_them() -> None:
    weights = {"version": 7, "ref": "/ckpt/7"}
    argv, env, info = launch_with_weights(["serve", "--model", "{weights_path}", "--port", "{port}"], weights, 9000,
                                          {"ready": False})
    assert argv == ["serve", "--model", "/ckpt/7", "--port", "9000"] and info["weights_version"] == 7
    assert env["SLURM_ELASTIC_WEIGHTS_PATH"] == "/ckpt/7" and env["SLURM_ELASTIC_WEIGHTS_VERSION"] == "7"
    argv, env, info = launch_with_weights(["serve", "--model", "/base"], weights, 9000, {"ready": False})
    assert "weights_version" not in info and env["SLURM_ELASTIC_WEIGHTS_PATH"] == "/ckpt/7"  # the hook updates it
    argv, env, info = launch_with_weights(["serve", "{weights_path}"], None, 9000, {})
    assert argv == ["serve", ""] and "SLURM_ELASTIC_WEIGHTS_PATH" not in env and "weights_version" not in info


def restarted(book: WeightsBook, now_s: float = 110.0) -> WeightsBook:
    """The book a restarted controller builds at ``now_s`` from what ``book``'s controller saved."""
    again = WeightsBook(max_failures=book.max_failures, retry_backoff_s=book.retry_backoff_s,
                        update_timeout_s=book.update_timeout_s)
    assert book.latest is not None
    again.publish(book.latest.version, book.latest.ref)
    again.rejoin(book.joined())
    again.restore_updates(book.saved_updates(), now_s)
    return again


def test_an_update_in_flight_at_a_restart_is_not_sent_again_until_it_has_ended_and_then_asks_first() -> None:
    """A restart in the middle of a publish sent the update a second time to a server loading it."""
    book = WeightsBook(update_timeout_s=60.0)
    book.publish(3, "/ckpt/3")
    [sent] = book.due(servers(2, 2), 100.0)[:1]
    book.done("0002", 3, "", 101.0)  # the other server loaded it before the restart
    again = restarted(book)
    assert again.saved_updates()["0001"].in_flight == 3 and again.server_view("0001")["weights_updating_to"] == 3
    assert again.due(servers(2, 3), 120.0) == []  # may still be loading: nothing sent
    [order] = again.due(servers(2, 3), 160.0)  # its time limit has passed: sent, asking its version first
    assert (order.worker_id, order.weights.version, order.confirm) == ("0001", 3, True) and not sent.confirm
    assert again.done("0001", 3, "", 161.0).action == "loaded"
    again.publish(4, "/ckpt/4")
    assert [o.confirm for o in again.due(servers(3, 3), 170.0)] == [False, False]


def test_times_ahead_of_the_clock_in_a_restored_record_keep_no_server_waiting_for_good() -> None:
    """A clock set back, or a damaged state.json (``sent_at_s`` 1e18), left a server in flight for good."""
    book = WeightsBook(update_timeout_s=300.0, retry_backoff_s=10.0, max_failures=3)
    book.publish(3, "/ckpt/3")
    again = WeightsBook(update_timeout_s=300.0, retry_backoff_s=10.0, max_failures=3)
    again.publish(3, "/ckpt/3")
    again.restore_updates({"0001": SavedUpdates(0, 3, False, 1e18, 0.0, ""),
                           "0002": SavedUpdates(1, None, False, 0.0, 1e18, "failed")}, 1000.0)
    assert again.due(servers(2, 2), 1000.0) == []  # the adopted update may still be loading; 0002 backs off
    due = again.due(servers(2, 2), 1000.0 + 300.0 + 1)  # past one update's limit and the longest backoff (40 s)
    assert sorted(o.worker_id for o in due) == ["0001", "0002"]


def test_failures_in_a_row_count_on_across_a_restart() -> None:
    """A server that kept failing was never replaced when the controller restarted in between."""
    book = WeightsBook(max_failures=3, retry_backoff_s=0.0)
    book.publish(3, "/ckpt/3")
    book.due(servers(3, 2), 0.0)  # 0001 loaded it: the weights are good
    for attempt in (1, 2):
        book.due(servers(3, 2), float(attempt))
        assert book.done("0002", 3, "HTTP 400", float(attempt)).action == "retry"
    again = restarted(book)
    assert again.server_view("0002")["weights_update_failures"] == 2
    [order] = again.due(servers(3, 2), 10.0)
    assert order.attempt == 3
    assert again.done("0002", 3, "HTTP 400", 10.0).action == "replace"
