"""A small stand-in for a SandboxFusion service (its `run_code` API), for the remote sandbox's
tests: it runs the code it is sent with this interpreter in a child process (no isolation:
it stands for the service, whose isolation is its own business) and answers in
SandboxFusion's format. `mode` makes it misbehave: "hang" (read the request, never answer),
"die" (close the connection without an answer), "error" (HTTP 500), "busy" (HTTP 503 on
the first `busy_tries` requests, then answer)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests += 1
        mode = self.server.mode
        if mode == "hang":
            self.server.release.wait()  # until the test ends
            return
        if mode == "die":
            self.connection.close()
            return
        if mode == "error" or (mode == "busy" and self.server.requests <= self.server.busy_tries):
            self.send_error(500 if mode == "error" else 503)
            return
        answer = _run(body["code"], float(body["run_timeout"]))
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _run(code: str, timeout: float) -> dict[str, Any]:
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="avrid-service-")  # each call in a directory of its own
    proc = subprocess.Popen([sys.executable, "-I", "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={}, cwd=workdir,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        run = {"status": "Finished", "return_code": proc.returncode}
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        run = {"status": "TimeLimitExceeded", "return_code": None}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    run.update(execution_time=time.monotonic() - start, stdout=out.decode(errors="replace"),
               stderr=err.decode(errors="replace"))
    ok = run["status"] == "Finished" and run["return_code"] == 0
    return {"status": "Success" if ok else "Failed", "message": "", "compile_result": None,
            "run_result": run, "executor_pod_name": None, "files": {}}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    mode = "ok"
    busy_tries = 0
    requests = 0
    release: threading.Event


@contextmanager
def sandbox_service(mode: str = "ok", *, busy_tries: int = 1) -> Iterator[str]:
    """A running service on 127.0.0.1 for the block; yields its URL."""
    server = _Server(("127.0.0.1", 0), _Handler)
    server.mode, server.busy_tries, server.release = mode, busy_tries, threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
