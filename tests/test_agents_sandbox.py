"""Chapter 7: tools in a sandbox (`avrid.agents.sandbox`). Each misbehaving tool — looping
forever, allocating without bound, writing outside its directory, reaching for the network,
starting processes, crashing — comes back as an observation that says so, within its limit;
nothing of it is left running and its directory is gone."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from avrid.agents.sandbox import ToolLimits, ToolResult, run_python

pytestmark = pytest.mark.chapter(7)

LIMITS = ToolLimits(wall_s=20.0, memory_mb=256)
"""Generous wall time: these tools end at once; a loaded machine must not turn that into a
timeout. The timeouts are tested with their own short limit."""


def gone(result: ToolResult) -> bool:
    """Whether no process of the tool's process group is left."""
    try:
        os.killpg(result.pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_tool_that_finishes_gives_its_output_and_may_use_its_own_directory() -> None:
    r = run_python("open('notes.txt', 'w').write('7')\nprint(6 * int(open('notes.txt').read()))",
                   LIMITS)
    assert (r.status, r.observation()) == ("ok", "42\n") and gone(r)


@pytest.mark.parametrize("code", ["while True: pass", "import time\ntime.sleep(60)"])
def test_a_tool_that_never_ends_is_killed_at_its_wall_time(code: str) -> None:
    r = run_python(code, ToolLimits(wall_s=1.0))
    assert r.status == "timeout" and "timed out" in r.observation()
    assert r.seconds >= 1.0 and gone(r)


@pytest.mark.parametrize("code", ["x = bytearray(10**10)",
                                  "chunks = []\nwhile True: chunks.append(bytearray(10**7))"])
def test_a_tool_that_allocates_without_bound_runs_out_of_memory(code: str) -> None:
    r = run_python(code, LIMITS)
    assert r.status == "memory" and r.observation() == "[tool ran out of memory]" and gone(r)


def test_writing_or_removing_outside_its_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / f"escape-{uuid.uuid4().hex}"
    r = run_python(f"open({str(target)!r}, 'w').write('x')", LIMITS)
    assert r.status == "denied" and "writing outside" in r.observation()
    assert not target.exists() and gone(r)
    keep = tmp_path / "keep"
    keep.write_text("mine")
    for code in (f"import os; os.remove({str(keep)!r})",
                 f"import os; os.rename({str(keep)!r}, 'stolen')",
                 f"import os; os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)"):
        r = run_python(code, LIMITS)
        assert r.status == "denied", (code, r)
    assert keep.read_text() == "mine" and not target.exists()


@pytest.mark.parametrize("code", [
    "import socket; socket.create_connection(('1.1.1.1', 80), timeout=1)",
    "import socket; s = socket.socket(); s.connect(('127.0.0.1', 9))",
    "import urllib.request; urllib.request.urlopen('http://example.com', timeout=1)"])
def test_the_network_is_refused(code: str) -> None:
    r = run_python(code, LIMITS)
    assert r.status == "denied" and "network" in r.observation() and gone(r)


@pytest.mark.parametrize("code", ["import subprocess; subprocess.run(['true'])",
                                  "import os; os.system('true')", "import os; os.fork()"])
def test_starting_processes_is_refused(code: str) -> None:
    r = run_python(code, LIMITS)
    assert r.status == "denied" and "processes" in r.observation() and gone(r)


@pytest.mark.parametrize(("code", "says"), [
    ("1 / 0", "ZeroDivisionError: division by zero"),
    ("import sys; sys.exit(3)", "exit status 3"),
    ("import faulthandler; faulthandler._sigsegv()", "killed by SIGSEGV"),
    ("print('x' * 10**7)", "File too large")])
def test_a_crash_comes_back_as_an_error_naming_it(code: str, says: str) -> None:
    r = run_python(code, LIMITS)
    assert r.status == "error" and says in r.observation() and gone(r)


def test_the_run_goes_on_and_leaves_no_directory_behind() -> None:
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("avrid-tool-*"))
    results = [run_python(c, LIMITS) for c in ("print(1)", "1/0")]
    results.append(run_python("while True: pass", ToolLimits(wall_s=1.0)))
    assert [r.status for r in results] == ["ok", "error", "timeout"]
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("avrid-tool-*")) <= before


def test_bad_limits_are_refused_naming_the_field() -> None:
    for field, value in (("wall_s", 0), ("memory_mb", -1), ("output_chars", float("nan"))):
        with pytest.raises(ValueError, match=f"ToolLimits.{field}"):
            ToolLimits(**{field: value})
