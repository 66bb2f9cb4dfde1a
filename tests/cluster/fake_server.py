"""A small HTTP "inference server" worker: POST /generate sleeps GEN_S (fake generation).

usage: fake_server.py PORT. GET /health answers 200. On the drain signal it stops once no
request is in flight and exits 0. On SIGUSR2 it hangs as a hung engine does: it still accepts
connections, never answers another request (health included, in flight or new), and ignores the
drain signal. Appends events to $FAKE_WORKER_LOG.
"""

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port = int(sys.argv[1]) + int(os.environ.get("SLURM_LOCALID", "0"))  # a second task on its node: the next port
worker_id = os.environ.get("SLURM_ELASTIC_WORKER_ID", "?")
gen_s = float(os.environ.get("GEN_S", "0.2"))
log_path = os.environ.get("FAKE_WORKER_LOG", "/dev/null")
rank = int(os.environ.get("SLURM_PROCID", "0"))  # a multi-node step runs one per node
node = os.environ.get("SLURMD_NODENAME", "")
lock = threading.Lock()
in_flight = 0
draining = threading.Event()
hung = threading.Event()


def event(kind: str, **extra: object) -> None:
    with lock, open(log_path, "a") as f:
        f.write(json.dumps({"worker": worker_id, "event": kind, "t": time.time(), "rank": rank, "node": node,
                            **extra}) + "\n")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *_args: object) -> None:
        pass

    def do_GET(self) -> None:
        if hung.is_set():
            threading.Event().wait()
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self) -> None:
        global in_flight
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))) or b"{}")
        with lock:
            in_flight += 1
        event("request_begin", id=body.get("id"), draining=draining.is_set())
        time.sleep(float(body.get("gen_s", gen_s)))
        if hung.is_set():
            threading.Event().wait()
        reply = json.dumps({"worker": worker_id, "id": body.get("id")}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)
        event("request_end", id=body.get("id"))
        with lock:
            in_flight -= 1


server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
signal.signal(signal.SIGUSR1, lambda *_: draining.set())
signal.signal(signal.SIGUSR2, lambda *_: hung.set())
threading.Thread(target=server.serve_forever, daemon=True).start()
event("start", port=port, pid=os.getpid(), gpus=os.environ.get("SLURM_STEP_GPUS", ""))
hung_logged = False
while True:
    time.sleep(0.05)
    with lock:
        idle = in_flight == 0
    if hung.is_set() and not hung_logged:
        hung_logged = True
        event("hung")
    if draining.is_set() and idle and not hung.is_set():
        event("drained")
        server.shutdown()
        sys.exit(0)
