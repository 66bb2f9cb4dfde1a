"""Weights follow the trainer: the latest published weights, kept durably, pushed to every server.

The trainer publishes a version with where its weights are (``POST /trainer/version`` with
``weights``); :class:`WeightsRecord` keeps the latest in ``weights.json`` in the job's state
directory (written atomically, read back by a restarted controller). :class:`WeightsPusher` runs
beside the reconcile loop: it asks the pure :class:`~slurm_elastic.core.weights.WeightsBook` which
ACTIVE servers are due an update, sends the updates in parallel (a thread pool, outside the
controller's lock) through the configured hook, each within ``weights.timeout_s``, and records the
outcome: the server's version, a retry (out of discovery meanwhile once another server has loaded
those weights), or a drain with the reason after ``weights.max_failures`` failures in a row of
weights another server loaded (the replacement is launched as for any drained worker).

The updates in flight are saved before they are sent (with each server's failures in a row, in the
state file), so a restarted controller does not send a server the update it may be loading; after
that update's time limit it asks a server that can say (SGLang's ``GET /get_weight_version``)
which version it runs before sending it again.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from slurm_elastic.controller.config_sections import WEIGHTS_PRESETS, WeightsSection
from slurm_elastic.controller.files import write_json_atomic
from slurm_elastic.core.lifecycle import WorkerState, begin_drain
from slurm_elastic.core.weights import PublishedWeights, ServerWeights, UpdateOrder, WeightsBook
from slurm_elastic.errors import SlurmElasticError
from slurm_elastic.slurm.runner import run_command

if TYPE_CHECKING:
    from slurm_elastic.controller.base import ControllerBase
    from slurm_elastic.controller.runtime import Controller

log = logging.getLogger(__name__)
WEIGHTS_FILE = "weights.json"
VERSION_PATHS = {"sglang": ("/get_weight_version", "weight_version")}  # where a preset's server says its version
POLL_S = 0.25  # the pusher looks for servers due an update at least this often


class WeightsRecord:
    """The latest published weights in ``<state dir>/weights.json``, with the book's fallback (the
    newest some server loaded) when the latest were not yet loaded by any."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / WEIGHTS_FILE

    def load(self) -> tuple[PublishedWeights, PublishedWeights | None] | None:
        """The saved (latest, fallback); None if none was saved. A damaged file is an error that names it."""
        try:
            data = json.loads(self.path.read_text())
            fallback = data.get("fallback")
            return (PublishedWeights(int(data["version"]), str(data["ref"])),
                    None if fallback is None else PublishedWeights(int(fallback["version"]), str(fallback["ref"])))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SlurmElasticError(f"{self.path}: not a weights record ({exc}); remove it or publish again") from None

    def save(self, latest: PublishedWeights, fallback: PublishedWeights | None) -> None:
        write_json_atomic(self.path, {"version": latest.version, "ref": latest.ref, **(
            {} if fallback is None else {"fallback": {"version": fallback.version, "ref": fallback.ref}})})


def weights_book(config: WeightsSection, enforced: bool) -> WeightsBook:
    """The controller's book for ``[weights]`` (``enforced``: servers with an update hook)."""
    return WeightsBook(enforced=enforced and config.update != "none", max_failures=config.max_failures,
                       retry_backoff_s=config.retry_backoff_s, update_timeout_s=config.timeout_s)


def restore_weights(controller: ControllerBase) -> None:
    """Load the latest published weights a previous controller kept (a damaged record is noted)."""
    try:
        saved = controller.weights_record.load()
    except SlurmElasticError as exc:
        controller.note_state(str(exc))
        return
    if saved is not None:
        controller.weights.publish(saved[0].version, saved[0].ref)
        controller.weights.fallback = saved[1]


def publish_weights(controller: Controller, version: int, ref: str) -> dict[str, Any]:
    """The trainer's new weights (validated by the route): kept durably, then pushed to every server."""
    with controller.lock:
        book = controller.weights
        controller.weights_record.save(PublishedWeights(version, ref), book.fallback_after(version, ref))
        book.publish(version, ref)
        controller.publish_endpoints()
    if controller.weights_wake is not None:
        controller.weights_wake.set()
    return {"version": version, "ref": ref}


def _save_if_proven(controller: ControllerBase, fallback_before: PublishedWeights | None) -> None:
    """A server loaded the latest weights, which clears the book's fallback: the record drops it
    too (else a restart would bring back weights the fleet no longer runs). Call under the lock."""
    book = controller.weights
    if fallback_before is not None and book.fallback is None and book.latest is not None:
        try:
            controller.weights_record.save(book.latest, None)
        except OSError as exc:  # kept in memory; the next publish writes the record again
            log.warning("weights: %s could not be written: %s", controller.weights_record.path, exc)


def latest_weights(book: WeightsBook) -> dict[str, Any] | None:
    """What a new server is told at registration: the latest published weights (None: none yet)."""
    latest = book.latest
    return None if latest is None else {"version": latest.version, "ref": latest.ref}


def render(template: Any, values: dict[str, str]) -> Any:
    """``template`` with ``{name}`` in every string replaced by ``values[name]`` (literally: other
    braces stay as they are), through lists and tables."""
    if isinstance(template, str):
        for key, value in values.items():
            template = template.replace("{" + key + "}", value)
        return template
    if isinstance(template, dict):
        return {k: render(v, values) for k, v in template.items()}
    if isinstance(template, list):
        return [render(v, values) for v in template]
    return template


class UpdateHook:
    """One server update through ``[weights]``: an HTTP request or a command. Returns '' when the
    server loaded the weights, else why not (never raises)."""

    def __init__(self, config: WeightsSection) -> None:
        self.config = config
        self.http = httpx.Client(timeout=config.timeout_s)

    def __call__(self, order: UpdateOrder) -> str:
        values = {"version": str(order.weights.version), "path": order.weights.ref, "url": order.url,
                  "worker_id": order.worker_id}
        cfg = self.config
        if cfg.update == "command":
            try:
                run_command(render(cfg.command, values), timeout_s=cfg.timeout_s)
            except SlurmElasticError as exc:
                return str(exc)
            return ""
        method, path, body = WEIGHTS_PRESETS.get(cfg.update, (cfg.method, cfg.path, cfg.body))
        try:
            reply = self.http.request(method, order.url.rstrip("/") + path, json=render(body, values))
        except httpx.TimeoutException:
            return f"no answer within {cfg.timeout_s:g} s"
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if not reply.is_success:
            return f"HTTP {reply.status_code}: {reply.text[:200]}"
        try:
            answer = reply.json()
        except ValueError:
            return ""
        if isinstance(answer, dict) and answer.get("success") is False:  # SGLang's failed update
            return f"the server refused: {str(answer.get('message', ''))[:200]}"
        return ""

    def loaded_version(self, order: UpdateOrder) -> int | None:
        """The weights version the server says it runs (None: its engine cannot say, or did not)."""
        path, key = VERSION_PATHS.get(self.config.update, ("", ""))
        if not path:
            return None
        try:
            reply = self.http.get(order.url.rstrip("/") + path)
            version = reply.json().get(key) if reply.is_success else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return int(version) if isinstance(version, int | str) and str(version).isdigit() else None

    def close(self) -> None:
        self.http.close()


class WeightsPusher:
    """Pushes the latest weights to every ACTIVE server of ``controller`` that runs another version."""

    def __init__(self, controller: Controller, hook: Callable[[UpdateOrder], str] | None = None,
                 loaded_version: Callable[[UpdateOrder], int | None] | None = None) -> None:
        self.controller = controller
        self.config = controller.config.weights
        self._hook = UpdateHook(self.config)
        self.hook = hook or self._hook
        self.loaded_version = loaded_version or self._hook.loaded_version
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._orders: queue.SimpleQueue[UpdateOrder | None] = queue.SimpleQueue()
        # daemon threads: an update hung until its timeout never holds up the controller's exit
        self._threads = [threading.Thread(target=self._loop, name="weights-pusher", daemon=True)] + [
            threading.Thread(target=self._send_loop, name=f"weights-{i}", daemon=True)
            for i in range(self.config.parallel)]
        self.pushed = self.failed = 0

    def start(self) -> WeightsPusher:
        """Run beside the loop (not at all where nothing is pushed: no servers or no update hook)."""
        self.controller.weights_wake = self.wake  # registrations and publishes wake the pusher at once
        if self.controller.weights.enforced:
            for thread in self._threads:
                thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()
        for _thread in self._threads[1:]:
            self._orders.put(None)
        if self._threads[0].is_alive():
            self._threads[0].join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.wake.wait(POLL_S)
            self.wake.clear()
            try:
                for order in self.due():
                    self._orders.put(order)
            except Exception:  # the pusher never dies on one bad round
                log.exception("weights pusher round failed")

    def _send_loop(self) -> None:
        while (order := self._orders.get()) is not None and not self._stop.is_set():
            self._push(order)

    def due(self) -> list[UpdateOrder]:
        """The updates to send now (the book marks them in flight; saved before they are sent, so a
        restarted controller knows them)."""
        ctl = self.controller
        with ctl.lock:
            servers = [ServerWeights(w.worker_id, w.endpoint, w.weights_version) for w in ctl.workers.values()
                       if w.state is WorkerState.ACTIVE and w.endpoint and not w.placeholder]
            fallback = ctl.weights.fallback
            orders = ctl.weights.due(servers, ctl.clock())
            _save_if_proven(ctl, fallback)
            if orders:
                try:
                    ctl.save()
                except OSError as exc:  # sent all the same: a restart in between may send them again
                    log.error("weights: could not save the updates in flight (%s)", exc)
            return orders

    def _push(self, order: UpdateOrder) -> None:
        if order.confirm and self._loaded_version(order) == order.weights.version:
            log.info("weights: %s runs version %d already (sent by an earlier controller)", order.worker_id,
                     order.weights.version)
            self.record(order, "")
            return
        log.info("weights: updating %s to version %d (%s), attempt %d", order.worker_id, order.weights.version,
                 order.weights.ref, order.attempt)
        try:
            error = self.hook(order)
        except Exception as exc:  # a hook that raises failed its update
            error = f"{type(exc).__name__}: {exc}"
        if not self._stop.is_set():  # a stopped controller records nothing more
            self.record(order, error)

    def _loaded_version(self, order: UpdateOrder) -> int | None:
        try:
            return self.loaded_version(order)
        except Exception:  # a read-back that raises tells nothing: the update is sent
            log.exception("weights: could not ask %s its version", order.worker_id)
            return None

    def record(self, order: UpdateOrder, error: str) -> None:
        """The outcome of ``order``: the server's version, out of discovery until a retry succeeds,
        or drained for replacement."""
        ctl = self.controller
        with ctl.lock:
            now_s = ctl.clock()
            fallback = ctl.weights.fallback
            outcome = ctl.weights.done(order.worker_id, order.weights.version, error, now_s)
            _save_if_proven(ctl, fallback)
            worker = ctl.workers.get(order.worker_id)
            if outcome.action == "loaded":
                self.pushed += 1
                if worker is not None:
                    worker.weights_version = order.weights.version
                log.info("weights: %s runs version %d", order.worker_id, order.weights.version)
            else:
                self.failed += 1
                log.warning("weights: %s: %s", order.worker_id, outcome.reason)
                if worker is not None and outcome.action == "replace" and worker.state is WorkerState.ACTIVE:
                    begin_drain(worker, now_s, outcome.reason)
            ctl.publish_endpoints()
            ctl.save()
        self.wake.set()  # a retry or the next version may be due
