"""Chapter 7: the remote sandbox (`avrid.agents.sandbox.remote`) when the service misbehaves.

A code-execution service is a network peer: it can hang, drop the connection, answer 500,
be busy for a moment, or not be there at all. Each is one clear result (status
"unavailable", naming the service and what went wrong) or, at start, one clear error —
never a hung run. The functional behaviour shared with the other backends (output, errors,
timeouts) is tested in `test_agents_sandbox.py`."""

from __future__ import annotations

import socket
import time

import pytest

from avrid.agents.sandbox import SandboxUnavailable, ToolLimits, make_sandbox
from avrid.agents.sandbox.remote import RemoteSandbox
from tests.sandbox_server import sandbox_service

pytestmark = pytest.mark.chapter(7)


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_service_that_hangs_is_an_unavailable_result_after_wall_time_plus_slack() -> None:
    with sandbox_service("hang") as url:
        sandbox = RemoteSandbox(url, slack_s=1.0)
        start = time.monotonic()
        r = sandbox.run("print(1)", ToolLimits(wall_s=1.0))
        took = time.monotonic() - start
    assert r.status == "unavailable" and url in r.output and "no answer within 2 s" in r.output
    assert "not retried" in r.observation() and 2.0 <= took < 10.0, (took, r)


@pytest.mark.parametrize(("mode", "says"), [("die", "RemoteDisconnected"),
                                            ("error", "HTTP 500")])
def test_a_service_that_dies_or_fails_is_one_unavailable_result(mode: str, says: str) -> None:
    with sandbox_service(mode) as url:
        r = RemoteSandbox(url, retries=1).run("print(1)", ToolLimits(wall_s=5.0))
    assert r.status == "unavailable" and says in r.output and url in r.output, r
    assert r.observation().startswith("[tool unavailable: ")


def test_a_busy_service_is_tried_again() -> None:
    with sandbox_service("busy", busy_tries=2) as url:
        r = RemoteSandbox(url, retries=2).run("print(6 * 7)", ToolLimits(wall_s=5.0))
    assert (r.status, r.output) == ("ok", "42\n")


def test_an_unreachable_service_is_refused_at_start_naming_its_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    sandbox = make_sandbox("remote", url=url, retries=0)
    with pytest.raises(SandboxUnavailable, match=f"{url}/run_code"):
        sandbox.check()
    r = sandbox.run("print(1)", ToolLimits(wall_s=1.0))  # later: a result, never a raise
    assert r.status == "unavailable" and "ConnectionRefusedError" in r.output


def test_a_reachable_service_passes_its_check() -> None:
    with sandbox_service() as url:
        make_sandbox("remote", url=url).check()


def test_a_bad_url_or_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="http:// or https://"):
        RemoteSandbox("sandbox:8080")
    with pytest.raises(ValueError, match="concurrency >= 1"):
        RemoteSandbox("http://x", concurrency=0)
