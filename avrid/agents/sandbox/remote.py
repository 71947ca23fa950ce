"""Chapter 7 — tools on a code-execution service: SandboxFusion's `run_code` API, over HTTP.

At scale the rollout's machines should not run the policy's code at all: a service of its
own (SandboxFusion, which verl's tools call; any server with the same API) runs it on other
machines, behind its own isolation. This backend is that service's client:

    POST {url}/run_code   {"code": ..., "language": "python", "run_timeout": wall_s,
                           "compile_timeout": ..., "memory_limit_MB": memory_mb}
    <-  {"status": "Success" | "Failed" | "SandboxError", "message": ...,
         "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error",
                        "return_code": N, "stdout": ..., "stderr": ..., ...}}

The code sent is `boot.program` with the tool's code embedded, so the call sets the same
rlimits as the local backends and ends with the same exit codes: the statuses mean what
they mean locally (run_result "TimeLimitExceeded" is "timeout").

A service is a network peer, so every way it can fail is bounded:

    concurrency      at most `concurrency` requests in flight from this process
    timeouts         connecting: `connect_s`; the answer: the call's wall time + `slack_s`
                     (each read of the socket; a service that hangs is a timeout)
    retries          a refused or reset connection, or a 502/503/504, is tried again up to
                     `retries` times (0.5 s, 1 s, ... apart); a timed-out request is not
                     (the code may have run: running it twice is not the same call)
    unreachable      `check()` raises `SandboxUnavailable` naming the URL (the trainer
                     calls it before the first rollout); later failures are one observation,
                     status "unavailable", naming the URL and what went wrong: never a hang,
                     never an exception in the episode loop

What it isolates is the service's business (SandboxFusion runs each call in its own
container-like sandbox); this client only sends code and reads answers.

Not here: the local backends (`namespaces.py`, `process.py`).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from avrid.agents.sandbox import boot
from avrid.agents.sandbox.base import SandboxUnavailable, ToolLimits, ToolResult

_RETRY_HTTP = (502, 503, 504)


class RemoteSandbox:
    """Tool calls on a SandboxFusion-compatible service at `url` (module docstring)."""

    name = "remote"

    def __init__(self, url: str, *, concurrency: int = 32, retries: int = 2,
                 connect_s: float = 5.0, slack_s: float = 10.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the remote sandbox's url must start with http:// or https://, "
                             f"got {url!r}")
        if concurrency < 1 or retries < 0 or connect_s <= 0 or slack_s <= 0:
            raise ValueError(f"RemoteSandbox: concurrency >= 1, retries >= 0, connect_s > 0 "
                             f"and slack_s > 0, got {concurrency}, {retries}, {connect_s}, "
                             f"{slack_s}")
        self.url = url.rstrip("/") + "/run_code"
        self.retries, self.connect_s, self.slack_s = retries, connect_s, slack_s
        self._slots = threading.BoundedSemaphore(concurrency)

    def check(self) -> None:
        """Run ``print(1)`` on the service; `SandboxUnavailable` if that does not give "1"."""
        result = self.run("print(1)", ToolLimits(wall_s=10.0))
        if (result.status, result.output.strip()) != ("ok", "1"):
            raise SandboxUnavailable(f"tools.sandbox='remote': the service at {self.url} did "
                                     f"not run a test call ({result.status}: "
                                     f"{result.output[:200]})")

    def run(self, code: str, limits: ToolLimits) -> ToolResult:
        """Send `code` to the service; a service that fails is status "unavailable"."""
        start = time.monotonic()
        payload = {"code": boot.program(limits, code=code), "language": "python",
                   "run_timeout": limits.wall_s, "compile_timeout": limits.wall_s,
                   "memory_limit_MB": limits.memory_mb}
        with self._slots:
            answer, problem = self._post(payload, timeout=limits.wall_s + self.slack_s)
        seconds = time.monotonic() - start
        if answer is None:
            return self._result("unavailable", f"{self.url}: {problem}", seconds, limits)
        status, text = _read(answer)
        return self._result(status, text, seconds, limits)

    def _result(self, status: Any, text: str, seconds: float, limits: ToolLimits) -> ToolResult:
        return ToolResult(status=status, output=text[:limits.output_chars], seconds=seconds,
                          pid=0, backend=self.name)

    def _post(self, payload: dict[str, Any], *,
              timeout: float) -> tuple[dict[str, Any] | None, str]:
        """The service's JSON answer, or (None, what went wrong) after the retries."""
        data = json.dumps(payload).encode()
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(0.5 * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=data, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    body = response.read()
            except urllib.error.HTTPError as e:
                problem = f"HTTP {e.code} {e.reason}"
                if e.code in _RETRY_HTTP:
                    continue
                return None, problem
            except TimeoutError:
                return None, f"no answer within {timeout:.0f} s (not retried: the code may " \
                             f"have run)"
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException,
                    OSError) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, TimeoutError):
                    return None, f"no answer within {timeout:.0f} s (not retried: the code " \
                                 f"may have run)"
                problem = f"{type(reason).__name__}: {reason}"
                continue
            try:
                answer = json.loads(body)
            except ValueError:
                return None, f"an answer that is not JSON: {body[:120]!r}"
            if not isinstance(answer, dict):
                return None, f"an answer that is not a JSON object: {body[:120]!r}"
            return answer, ""
        return None, f"{problem} (after {self.retries + 1} tries)"


def _read(answer: dict[str, Any]) -> tuple[Any, str]:
    """(status, text) of a run_code answer (see the module docstring)."""
    run = answer.get("run_result")
    if answer.get("status") == "SandboxError" or not isinstance(run, dict):
        return "unavailable", f"the service could not run the code: " \
                              f"{answer.get('message') or answer.get('status')!r}"
    if run.get("status") == "TimeLimitExceeded":
        return "timeout", ""
    code = run.get("return_code")
    if not isinstance(code, int):
        return "error", f"the service ran the code but gave no exit code ({run.get('status')})"
    return boot.outcome(code, str(run.get("stdout") or ""), str(run.get("stderr") or ""))
