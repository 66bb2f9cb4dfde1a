"""An admission whose answer never reached the worker (a timeout, a dropped connection): its
retry, with the same ``admission_id``, gets the first try's grant and is not granted again, so
the worker's lease holds only what it will use; a controller restart in between changes nothing.
So does a repeat that arrives late (after the worker asked again, or used its grant): any of the
worker's last ``ADMISSION_IDS_KEPT`` ids is answered from memory. Only the last id granted any
is saved: a late request comes on a connection to the process that answered it, and a restart
ends those; what a restarted controller must answer again is the worker's last ask. A retry that
comes while its first try still saves (an admission, or a trainer's version publish) is answered
only once saved, and what it was told holds whether or not the first try's save failed."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from slurm_elastic.client.control import ControlClient
from slurm_elastic.core.staleness import ADMISSION_IDS_KEPT, Lease
from slurm_elastic.core.staleness_snapshot import StalenessSnapshot
from slurm_elastic.rollouts.queue import QueueConfig, RolloutQueue
from slurm_elastic.rollouts.refusals import StaleGroup, VersionAhead
from slurm_elastic.rollouts.store import RolloutStore
from slurm_elastic.worker import RolloutWorker
from slurm_elastic.worker.context import StepContext
from slurm_elastic.worker.control import FollowingControl
from tests.unit.served_controller import ServedController

TOKEN = "admit-token"


def make(tmp: Path) -> RolloutQueue:
    config = QueueConfig(batch_size=4, capacity_seqs=100, max_staleness=1, max_concurrent=1000, fsync="off")
    return RolloutQueue(RolloutStore(tmp / "q.sqlite", fsync="off"), config, clock=lambda: 1000.0)


def test_a_retried_admission_is_granted_once_even_across_a_restart(tmp_path: Path) -> None:
    q = make(tmp_path)
    assert q.admit(4, "0001", "a1") == 4 and q.admit(4, "0001", "a1") == 4  # the retry
    assert q.staleness.running == 4 and q.leases.leases["0001"].unused_seqs == 4
    q.store.close()
    again = make(tmp_path)
    assert again.admit(4, "0001", "a1") == 4 and again.staleness.running == 4  # its answer lost at the restart
    assert again.admit(4, "0001", "a2") == 4 and again.staleness.running == 8  # a new ask is a new grant
    assert again.admit(4, "0002") == 0  # (1 + 0 + 1) * 4 - 8: nothing left


def test_a_new_id_or_none_is_a_new_admission(tmp_path: Path) -> None:
    q = make(tmp_path)
    assert q.admit(2, "0001", "a1") == 2 and q.admit(2, "0001") == 2 and q.admit(2, "0001") == 2
    assert q.staleness.running == 6


def test_a_late_repeat_of_an_older_id_is_answered_not_granted_again(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    q = make(tmp_path)
    assert q.admit(2, "0001", "a1") == 2 and q.admit(2, "0001", "a2") == 2
    assert q.admit(2, "0001", "a1") == 2 and q.staleness.running == 4  # a1 arrives again, late
    assert q.submit("g1", "0001", 4, 0, b"x")  # the worker uses its whole lease
    assert q.admit(2, "0001", "a2") == 2 and q.staleness.running == 0  # a late repeat: nothing more held
    assert q.admit(2, "0001", "a2") == 2  # (or a client that sends one id for every ask: told once)
    told = [r.getMessage() for r in caplog.records if "repeated admission id" in r.getMessage()]
    assert told == ["worker 0001 repeated admission id a2 after using what it was granted: answered, not granted "
                    "again (a request that came late, or a client that sends one id for several asks: each ask "
                    "needs its own admission_id)"]
    assert q.admit(8, "0002", "b1") == 4 and q.admit(8, "0002", "b1") == 4  # (1 + 0 + 1) * 4 - 4 accepted
    q.store.close()
    again = make(tmp_path)
    assert again.admit(2, "0001", "a2") == 2 and again.admit(8, "0002", "b1") == 4  # the last ids survive a restart
    assert again.staleness.running == 4 and again.staleness.capacity() == 0


def test_a_grant_of_none_is_remembered_and_a_failed_save_forgets_its_id(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    q = make(tmp_path)
    assert q.admit(8, "0001", "a1") == 8 and q.admit(4, "0002", "b1") == 0  # the bound is full
    q.release_leases(["0001"])  # room again; b1's answer was "none"
    assert q.admit(4, "0002", "b1") == 0 and q.admit(4, "0002", "b2") == 4
    monkeypatch.setattr(q.store, "save_staleness", lambda _snapshot: (_ for _ in ()).throw(OSError("disk")))
    with pytest.raises(OSError):
        q.admit(4, "0003", "c1")
    assert q.staleness.running == 4 and "0003" not in q.leases.leases  # nothing happened
    monkeypatch.undo()
    assert q.admit(4, "0003", "c1") == 4  # its retry is a new ask, granted


class SlowSaves:
    """The store's staleness saves wait for ``go``; the first one fails if ``fail_first``."""

    def __init__(self, q: RolloutQueue, fail_first: bool) -> None:
        self.save, self.fail_first = q.store.save_staleness, fail_first
        self.go, self.saving, self.calls = threading.Event(), threading.Event(), 0
        q.store.save_staleness = self  # type: ignore[method-assign]

    def __call__(self, snapshot: StalenessSnapshot) -> None:
        self.calls += 1
        self.saving.set()
        assert self.go.wait(10)
        if self.fail_first and self.calls == 1:
            raise OSError("disk")
        self.save(snapshot)


def admit_in_thread(q: RolloutQueue, answers: list[object]) -> threading.Thread:
    def ask() -> None:
        try:
            answers.append(q.admit(4, "0001", "a1"))
        except OSError as exc:
            answers.append(exc)

    thread = threading.Thread(target=ask)
    thread.start()
    return thread


class HeldBackLock:
    """The book's lock, except that the thread named in ``held_back`` waits for ``go`` before it
    takes it (what a scheduler may do to a thread whose save just failed)."""

    def __init__(self) -> None:
        self.lock, self.go = threading.Lock(), threading.Event()
        self.held_back: threading.Thread | None = None

    def __enter__(self) -> None:
        if threading.current_thread() is self.held_back:
            assert self.go.wait(10)
        self.lock.acquire()

    def __exit__(self, *_exc: object) -> None:
        self.lock.release()


@pytest.mark.parametrize("fail_first", [False, True])
def test_a_retry_sent_while_the_first_try_still_saves_is_answered_only_once_saved(tmp_path: Path,
                                                                                 fail_first: bool) -> None:
    q = make(tmp_path)
    saves = SlowSaves(q, fail_first)
    first: list[object] = []
    retry: list[object] = []
    threads = [admit_in_thread(q, first)]
    assert saves.saving.wait(10)  # the first try writes its grant ...
    threads.append(admit_in_thread(q, retry))  # ... when its retry comes (the worker timed out)
    time.sleep(0.2)
    assert retry == []  # not answered before the grant is saved
    saves.go.set()
    for thread in threads:
        thread.join(10)
    assert retry == [4]  # told it may start 4: those 4 are held, and saved
    assert first == [4] or (fail_first and isinstance(first[0], OSError))
    assert q.staleness.running == 4 and q.leases.leases["0001"].unused_seqs == 4
    q.store.close()
    again = make(tmp_path)
    assert again.staleness.running == 4 and again.admit(4, "0001", "a1") == 4 and again.staleness.running == 4


def test_a_grant_whose_save_failed_is_kept_when_its_retrys_save_held_it(tmp_path: Path) -> None:
    q = make(tmp_path)
    lock = HeldBackLock()
    q.book.lock = lock  # type: ignore[assignment]
    saves = SlowSaves(q, fail_first=True)
    first: list[object] = []
    retry: list[object] = []
    threads = [admit_in_thread(q, first)]
    assert saves.saving.wait(10)
    lock.held_back = threads[0]  # once its save fails, the first try is slow to take the lock back
    threads.append(admit_in_thread(q, retry))
    saves.go.set()
    threads[1].join(10)
    assert retry == [4] and saves.calls == 2  # the retry's own save held the grant
    lock.go.set()
    threads[0].join(10)
    assert first == [4]  # not taken back: the worker was told it may start those 4
    assert q.staleness.running == 4 and q.leases.leases["0001"].answer("a1") == 4


@pytest.mark.parametrize("fail_first", [False, True])
def test_a_publish_retried_while_its_first_try_saves_stays_published(tmp_path: Path, fail_first: bool) -> None:
    q = make(tmp_path)
    saves = SlowSaves(q, fail_first)
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            q.set_version(1)
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=publish)]
    threads[0].start()
    assert saves.saving.wait(10)
    threads.append(threading.Thread(target=publish))  # the trainer's retry
    threads[1].start()
    saves.go.set()
    for thread in threads:
        thread.join(10)
    assert len(errors) <= (1 if fail_first else 0)  # the trainer was told version 1 is published ...
    assert q.staleness.version == 1  # ... and it is, here ...
    q.store.close()
    assert make(tmp_path).staleness.version == 1  # ... and after a restart


def test_a_stale_refusal_keeps_the_ids_and_only_the_last_ones_are_kept(tmp_path: Path) -> None:
    q = make(tmp_path)
    q.set_version(2)
    assert q.admit(2, "0001", "a1") == 2
    with pytest.raises(StaleGroup):
        q.submit("g-old", "0001", 2, 0, b"x")  # version 0 < 2 - 1: stale, its lease released
    assert q.staleness.running == 0 and q.admit(2, "0001", "a1") == 2 and q.staleness.running == 0
    for n in range(ADMISSION_IDS_KEPT + 1):
        q.admit(0, "0001", f"n{n}")
    lease = q.leases.leases["0001"]
    assert lease.answer("n0") is None and lease.answer(f"n{ADMISSION_IDS_KEPT}") == 0
    assert len(lease.answered) == ADMISSION_IDS_KEPT


def test_a_resent_refused_group_releases_nothing_again_even_across_a_restart(tmp_path: Path) -> None:
    """A stale or too-new group's release (AReaL's on_rollout_rejected) happens once per group: the
    SDK resends through lost answers, and before, each resend of a refused group released the
    worker's other admitted sequences (running 8 -> 6 -> 4 -> 2 -> 0 with 6 rollouts still
    generating), so other workers were granted past the bound."""
    q = make(tmp_path)  # batch 4, max_staleness 1: (1 + V + 1) * 4
    q.set_version(2)
    assert q.admit(4, "0001", "a1") == 4 and q.admit(4, "0002", "b1") == 4  # capacity (1 + 2 + 1) * 4 = 16
    for _ in range(4):  # the first try, then resends whose answers were lost
        with pytest.raises(StaleGroup):
            q.submit("g-old", "0001", 1, 0, b"x")
    assert q.staleness.running == 7 and q.leases.leases["0001"].unused_seqs == 3
    with pytest.raises(VersionAhead):
        q.submit("g-new", "0001", 1, 9, b"x")
    q.store.close()  # a restart between the release's save and its answer
    again = make(tmp_path)
    for _ in range(3):  # the worker's refused groups are saved with the counts
        with pytest.raises(VersionAhead):
            again.submit("g-new", "0001", 1, 9, b"x")
    assert again.staleness.running == 6 and again.admit(16, "0003", "c1") == 16 - 6  # nothing past the bound
    with pytest.raises(StaleGroup):  # an older refused one too (before, only the last was saved, and
        again.submit("g-old", "0001", 1, 0, b"x")  # this resend released once more: 15 running)
    assert again.staleness.running == 16 and again.stats()["staleness_capacity"] == 0


def test_a_group_refused_while_its_worker_held_no_lease_releases_nothing_from_a_later_one(tmp_path: Path) -> None:
    """Stale groups come most often from a worker whose lease expired: its refusal released
    nothing and was not remembered, so the resend, after the worker was granted anew, took its
    sequences off the new lease (running 4 -> 2: two rollouts past the bound; a differential run
    against AReaL's StalenessManager found it). A give-back resent the same way is the same."""
    q = make(tmp_path)
    q.set_version(2)
    with pytest.raises(StaleGroup):
        q.submit("g1", "0001", 2, 0, b"x")  # no lease: nothing to release
    q.give_back(2, "0001", "r1")
    assert q.admit(4, "0001", "a1") == 4 and q.staleness.running == 4
    for _ in range(2):
        with pytest.raises(StaleGroup):
            q.submit("g1", "0001", 2, 0, b"x")
        assert q.give_back(2, "0001", "r1") == 0
    assert q.staleness.running == 4
    q.store.close()
    again = make(tmp_path)
    with pytest.raises(StaleGroup):
        again.submit("g1", "0001", 2, 0, b"x")
    assert again.give_back(2, "0001", "r1") == 0 and again.staleness.running == 4


def test_a_give_back_that_released_nothing_is_saved_before_its_answer(tmp_path: Path) -> None:
    """Its id must survive a restart too: a retry of it after the restart, once the worker was
    granted anew, released 2 of the new lease (a code review)."""
    q = make(tmp_path)
    q.set_version(2)
    assert q.give_back(2, "0001", "r1") == 0
    q.store.close()  # a restart before any other save
    again = make(tmp_path)
    assert again.admit(4, "0001", "a1") == 4
    assert again.give_back(2, "0001", "r1") == 0 and again.staleness.running == 4


def test_only_the_last_granted_id_is_saved_and_earlier_forms_still_load() -> None:
    def lease(saved: str) -> Lease:
        return StalenessSnapshot.from_json(
            f'{{"version":3,"gross_seqs":8,"at_seq":2,"leases":{{"0001":{saved}}}}}').leases["0001"]

    held = Lease(4, 99.5, "a2", 2, (("a1", 4), ("a2", 2), ("a3", 0)))
    zero_grants_only = Lease(0, 1.0, answered=(("b1", 0),))
    saved = StalenessSnapshot(3, 8, 2, {"0001": held, "0002": zero_grants_only}).to_json()
    assert '"leases":{"0001":[4,99.5,"a2",2]}' in saved
    assert lease('[4,99.5,"a2",2]') == Lease(4, 99.5, "a2", 2) and lease('[4,99.5,"a2",2]').answer("a2") == 2
    assert lease("[4,99.5]") == Lease(4, 99.5)  # before admissions had ids
    refused = StalenessSnapshot(3, 8, 2, {"0001": Lease(2, 99.5, "a2", 2)}, {"0001": ("g-0", "g-old"), "0002": ("g",)})
    assert refused.to_json().endswith('"leases":{"0001":[2,99.5,"a2",2]},"refused":{"0001":["g-0","g-old"],"0002":["g"]}}')
    assert StalenessSnapshot.from_json(refused.to_json()) == refused
    earlier = StalenessSnapshot.from_json('{"version":3,"gross_seqs":8,"at_seq":2,"leases":{"0001":[2,99.5,"a2",2,"g-old"]}}')
    assert earlier.leases["0001"] == Lease(2, 99.5, "a2", 2) and earlier.refused == {"0001": ("g-old",)}
    for bad in ('{"0001":"g"}', '{"0001":[1]}', '{"0001":' + str(["g"] * 17).replace("'", '"') + "}"):
        with pytest.raises(ValueError, match="not a staleness snapshot"):
            StalenessSnapshot.from_json(f'{{"version":3,"gross_seqs":8,"at_seq":2,"leases":{{}},"refused":{bad}}}')
    for bad in ("[4]", '[4,99.5,"a1",-1]', '[4,99.5,"a1"]', '[4,99.5,[["a1",4]]]'):
        with pytest.raises(ValueError, match="not a staleness snapshot"):
            lease(bad)


class LosesAnswers(httpx.HTTPTransport):
    """The controller acts on the requests to ``path``; the first ``n`` answers never arrive."""

    def __init__(self, path: str, n: int) -> None:
        super().__init__()
        self.path, self.left = path, n

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path == self.path and self.left:
            response.read()
            response.close()
            self.left -= 1
            raise httpx.ReadError("the answer was lost", request=request)
        return response


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedController]:
    server = ServedController(tmp_path, TOKEN, {"autoscaler": {"min_workers": 0}}, batch_size=8).launched(
        "0001", "0002", "0003")
    yield server
    server.close()


def test_the_sdk_repeats_its_admission_id_and_holds_one_grant(served: ServedController,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_ELASTIC_WORKER_ID", "0001")
    monkeypatch.setenv("SLURM_ELASTIC_CONTROLLER_URL", served.url)
    monkeypatch.setenv("SLURM_ELASTIC_TOKEN", TOKEN)
    ctx = StepContext.from_env()
    transport = LosesAnswers("/rollouts/admission", 3)
    control = FollowingControl(ctx.worker_id, ctx.controller_url, ctx.token, ctx.state_dir,
                               connect=lambda url, token: ControlClient(url, token, transport=transport))
    with RolloutWorker(ctx, control) as worker:
        assert worker.admit(4) == 4
    assert transport.left == 0 and served.queue.staleness.running == 4  # not 16


def test_a_submit_whose_first_answer_was_lost_reads_as_stored(served: ServedController) -> None:
    transport = LosesAnswers("/rollouts", 1)
    with ControlClient(served.url, TOKEN, transport=transport) as client:
        group = {"id": "g1", "worker_id": "0001", "policy_version": 0, "group_size": 1,
                 "sequences": [{"tokens": [1, 2], "score": 0.5}]}
        assert client.submit_group(group, sleep=lambda _s: None) == {"accepted": True, "resent": True}
        assert client.submit_group(group) == {"accepted": False}  # a resend of the caller's own: as before
    assert served.queue.stats()["queued_groups"] == 1


def test_a_worker_without_a_token_is_told_at_once() -> None:
    from slurm_elastic.errors import ConfigError

    with pytest.raises(ConfigError, match="no token for the controller"):
        StepContext.from_env({"SLURM_ELASTIC_WORKER_ID": "0001", "SLURM_ELASTIC_CONTROLLER_URL": "http://x:1"})


@pytest.mark.parametrize(("name", "value", "says"), [
    ("SLURM_ELASTIC_HEARTBEAT_INTERVAL_S", "abc", "'abc' is not a number of seconds"),
    ("SLURM_ELASTIC_HEARTBEAT_INTERVAL_S", "nan", "'nan' is not a number of seconds above 0"),
    ("SLURM_ELASTIC_HEARTBEAT_INTERVAL_S", "-5", "'-5' is not a number of seconds above 0"),
    ("SLURM_ELASTIC_START_TIMEOUT_S", "1e300", "'1e300' is not a number of seconds above 0 and at most 31622400"),
    ("SLURM_ELASTIC_LIVENESS_TIMEOUT_S", "inf", "'inf' is not a number of seconds"),
    ("SLURM_ELASTIC_LIVENESS_FAILURE_THRESHOLD", "2.5", "'2.5' is not a whole number from 0 to 1000"),
    ("SLURM_PROCID", "x", "'x' is not a whole number from 0 to 65535"),
    ("SLURM_ELASTIC_WORKER_KIND", "serve", "'serve' is not rollout or server"),
])
def test_a_worker_environment_that_cannot_be_read_is_named(name: str, value: str, says: str) -> None:
    """A worker run by hand with a wrong variable: before, ``abc`` ended in a ValueError traceback,
    and ``nan`` or ``-5`` seconds were taken (a heartbeat loop that never waits)."""
    from slurm_elastic.errors import ConfigError

    env = {"SLURM_ELASTIC_WORKER_ID": "0001", "SLURM_ELASTIC_CONTROLLER_URL": "http://x:1", "SLURM_ELASTIC_TOKEN": TOKEN}
    assert StepContext.from_env(env).heartbeat_interval_s == 5.0
    with pytest.raises(ConfigError, match=f"^{name}: " + re.escape(says)):
        StepContext.from_env({**env, name: value})


def test_a_replayed_admission_over_http_takes_no_capacity(served: ServedController) -> None:
    with ControlClient(served.url, TOKEN) as client:
        assert client.admit(4, "0001", "a1")["granted"] == 4 and client.admit(4, "0001", "a2")["granted"] == 4
        for _ in range(5):  # a client (or a proxy) that replays its old requests
            assert client.admit(4, "0001", "a1")["granted"] == 4
    assert served.queue.staleness.running == 8
