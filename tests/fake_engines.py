"""Fake inference engines with SGLang's and vLLM's health and weight-update endpoints, as their docs
describe them, for tests of weights following the trainer. No model: the "weights" are the path
last loaded.

SGLang (native server): ``GET /health``; ``POST /update_weights_from_disk`` with
``{"model_path", "weight_version"?, "load_format"?, "abort_all_requests"?}`` answers
``{"success", "message", "num_paused_requests"}`` (400 with ``success: false`` on failure);
``GET /get_weight_version``; ``GET /get_model_info``.
vLLM (OpenAI server with ``VLLM_SERVER_DEV_MODE=1``): ``GET /health``; ``POST /collective_rpc`` with
``{"method": "reload_weights", "kwargs": {"weights_path": ...}}`` answers ``{"results": [...]}``
(500 when the worker raises); ``GET /v1/models``.
Both: ``POST /generate`` answers ``{"worker", "id", "weights_path"}`` (what it runs now).

``update``: ``ok``; ``fail`` (every update fails as the engine reports a failed load); ``hang``
(an update is accepted and never answered; health still answers); $FAKE_UPDATE_FAILS_ON: worker ids
(comma-separated) whose updates fail. Events go to $FAKE_WORKER_LOG.

    python tests/fake_engines.py sglang|vllm PORT [--update ok|fail|hang] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeEngine:
    """One engine's state: the weights it runs, how it answers updates, what it saw."""

    def __init__(self, engine: str, update: str = "ok", model: str = "", worker_id: str = "",
                 log_path: str = "") -> None:
        if engine not in ("sglang", "vllm") or update not in ("ok", "fail", "hang"):
            raise ValueError(f"unknown engine {engine!r} or update mode {update!r}")
        self.engine, self.update, self.worker_id, self.log_path = engine, update, worker_id, log_path
        self.weights_path = model
        self.weight_version: str | None = None
        self.updates: list[dict[str, Any]] = []  # every update request body, in order
        self.lock = threading.Lock()
        self.release = threading.Event()  # set: hung updates return (tests end cleanly)

    def event(self, kind: str, **extra: object) -> None:
        if self.log_path:
            with self.lock, open(self.log_path, "a") as f:
                f.write(json.dumps({"worker": self.worker_id, "event": kind, "t": time.time(), **extra}) + "\n")

    def handle(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if method == "GET" and path == "/health":
            return 200, {}
        if method == "POST" and path == "/generate":
            self.event("request_begin", id=body.get("id"), weights_path=self.weights_path)
            return 200, {"worker": self.worker_id, "id": body.get("id"), "weights_path": self.weights_path}
        if self.engine == "sglang":
            return self._sglang(method, path, body)
        return self._vllm(method, path, body)

    def _load(self, new_path: Any, version: Any) -> str:
        """'' when loaded, else the engine's error text (blocks forever in ``hang`` mode)."""
        with self.lock:
            self.updates.append({"path": new_path, "version": version})
        self.event("update", weights_path=new_path, version=version)
        if self.update == "hang":
            self.release.wait()
            return "released"
        if self.update == "fail":
            return f"Failed to load weights from {new_path}: safetensors header is corrupt"
        if not isinstance(new_path, str) or not new_path:
            return "model_path is required"
        self.weights_path, self.weight_version = new_path, version
        self.event("loaded", weights_path=new_path, version=version)
        return ""

    def _sglang(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if method == "POST" and path == "/update_weights_from_disk":
            error = self._load(body.get("model_path"), body.get("weight_version"))
            if error:
                return 400, {"success": False, "message": error, "num_paused_requests": 0}
            return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        if method == "GET" and path == "/get_weight_version":
            return 200, {"weight_version": self.weight_version}
        if method == "GET" and path == "/get_model_info":
            return 200, {"model_path": self.weights_path, "is_generation": True}
        return 404, {"detail": "Not Found"}

    def _vllm(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if method == "POST" and path == "/collective_rpc":
            if "method" not in body:
                return 400, {"detail": "Missing 'method' in request body"}
            if body["method"] != "reload_weights":
                return 500, {"error": f"worker has no method {body['method']!r}"}
            error = self._load((body.get("kwargs") or {}).get("weights_path"), None)
            if error:
                return 500, {"error": {"message": error, "type": "InternalServerError", "code": 500}}
            return 200, {"results": [None]}
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.weights_path, "object": "model"}]}
        return 404, {"detail": "Not Found"}


def make_server(engine: FakeEngine, port: int = 0, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """An HTTP server for ``engine`` (not started: ``serve_forever`` it in a thread)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_args: object) -> None:
            pass

        def _answer(self, method: str) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length", "0") or 0))
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                code, answer = 400, {"detail": "JSON decode error"}
            else:
                code, answer = engine.handle(method, self.path.split("?", 1)[0], body)
            data = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("engine", choices=["sglang", "vllm"])
    parser.add_argument("port", type=int)
    parser.add_argument("--update", choices=["ok", "fail", "hang"], default=os.environ.get("FAKE_UPDATE", "ok"))
    parser.add_argument("--model", default="base")
    args = parser.parse_args()
    worker_id = os.environ.get("SLURM_ELASTIC_WORKER_ID", "?")
    failing = os.environ.get("FAKE_UPDATE_FAILS_ON", "").split(",")  # worker ids whose updates fail
    update = "fail" if worker_id in failing else args.update
    engine = FakeEngine(args.engine, update, args.model, worker_id, os.environ.get("FAKE_WORKER_LOG", ""))
    server = make_server(engine, args.port, "0.0.0.0")
    stop = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: stop.set())  # the drain signal: stop serving
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine.event("start", port=args.port, weights_path=engine.weights_path)
    stop.wait()
    engine.release.set()
    server.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
