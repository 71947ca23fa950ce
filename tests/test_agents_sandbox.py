"""Chapter 7: tools in a sandbox (`avrid.agents.sandbox`), what every backend does alike.

Each misbehaving tool — looping forever, allocating without bound, crashing, printing without
end — comes back as a result that says so, within its limit, with nothing of it left. The
same tests run on the three backends: `namespaces` (skipped, with the reason, where this
machine cannot create namespaces), `process`, and `remote` against a local stand-in for a
SandboxFusion service (`tests/sandbox_server.py`). The escape attempts against the default
backend are `test_agents_sandbox_escapes.py`."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from avrid.agents.sandbox import (
    Sandbox,
    SandboxUnavailable,
    ToolLimits,
    ToolResult,
    make_sandbox,
    run_python,
    use_sandbox,
)
from avrid.agents.sandbox.process import ProcessSandbox
from tests.helpers import child_env
from tests.sandbox_server import sandbox_service

pytestmark = pytest.mark.chapter(7)

ROOT = Path(__file__).resolve().parents[1]

LIMITS = ToolLimits(wall_s=20.0, memory_mb=256)
"""Generous wall time: these tools end at once; a loaded machine must not turn that into a
timeout. The timeouts are tested with their own short limit."""


def namespaces_or_skip() -> Sandbox:
    sandbox = make_sandbox("namespaces")
    try:
        sandbox.check()
    except SandboxUnavailable as e:
        pytest.skip(f"the namespaces backend cannot run here: {e}")
    return sandbox


def local_sandbox() -> Sandbox:
    """The best local backend here: namespaces, else (said in the test's output) process,
    for tests of something else that runs a tool (a recipe, the episode loop)."""
    sandbox = make_sandbox("namespaces")
    try:
        sandbox.check()
    except SandboxUnavailable as e:
        print(f"namespaces unavailable ({e}): the process backend instead")
        return process_sandbox()
    return sandbox


def process_sandbox() -> Sandbox:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "not a boundary": we know
        return make_sandbox("process")


@pytest.fixture(scope="module")
def service() -> Iterator[str]:
    with sandbox_service() as url:
        yield url


@pytest.fixture(params=["namespaces", "process", "remote"])
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    if request.param == "namespaces":
        return namespaces_or_skip()
    if request.param == "process":
        return process_sandbox()
    return make_sandbox("remote", url=request.getfixturevalue("service"))


def gone(result: ToolResult) -> bool:
    """Whether nothing the call started is left: its process group (local backends) and
    every live process of its PID namespace (namespaces backend)."""
    if result.pid:
        try:
            os.killpg(result.pid, 0)
            return False
        except ProcessLookupError:
            pass
    return result.namespace is None or not in_namespace(result.namespace)


def in_namespace(namespace: int) -> list[int]:
    """Live (not zombie) host processes in PID namespace `namespace`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/pid").st_ino != namespace:
                continue
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(pid))
    return found


@pytest.fixture(autouse=True)
def private_tempdir(tmp_path_factory: pytest.TempPathFactory,
                    monkeypatch: pytest.MonkeyPatch) -> Path:
    """Temporary files of this process go to a directory of the test's own, so `tool_dirs`
    sees only what this test's calls left (other processes write the system's /tmp)."""
    path = tmp_path_factory.mktemp("tempdir")
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


def tool_dirs() -> set[Path]:
    """What this process's tool calls have in the temporary directory (`private_tempdir`)."""
    return set(Path(tempfile.gettempdir()).iterdir())


def test_a_tool_that_finishes_gives_its_output_and_may_use_its_own_directory(
        sandbox: Sandbox) -> None:
    r = sandbox.run("open('notes.txt', 'w').write('7')\n"
                    "print(6 * int(open('notes.txt').read()))", LIMITS)
    assert (r.status, r.observation(), r.backend) == ("ok", "42\n", sandbox.name) and gone(r)


@pytest.mark.parametrize("code", ["while True: pass", "import time\ntime.sleep(60)"])
def test_a_tool_that_never_ends_is_killed_at_its_wall_time(sandbox: Sandbox, code: str) -> None:
    r = sandbox.run(code, ToolLimits(wall_s=1.0))
    assert r.status == "timeout" and "timed out" in r.observation()
    assert 1.0 <= r.seconds < 15.0 and gone(r)


@pytest.mark.parametrize("code", ["x = bytearray(10**10)",
                                  "chunks = []\nwhile True: chunks.append(bytearray(10**7))"])
def test_a_tool_that_allocates_without_bound_runs_out_of_memory(sandbox: Sandbox,
                                                                code: str) -> None:
    r = sandbox.run(code, LIMITS)
    assert r.status == "memory" and r.observation() == "[tool ran out of memory]" and gone(r)


@pytest.mark.parametrize(("code", "says"), [
    ("1 / 0", "ZeroDivisionError: division by zero"),
    ("import sys; sys.exit(3)", "exit status 3"),
    ("import faulthandler; faulthandler._sigsegv()", "SIGSEGV"),
    ("raise ValueError('bad' * 3)", "ValueError: badbadbad")])
def test_a_crash_comes_back_as_an_error_naming_it(sandbox: Sandbox, code: str,
                                                  says: str) -> None:
    r = sandbox.run(code, LIMITS)
    assert r.status == "error" and says in r.observation() and gone(r), r


@pytest.mark.parametrize("code", [
    "import socket; socket.create_connection(('1.1.1.1', 80), timeout=1)",
    "import socket; socket.getaddrinfo('example.com', 80)",
    "import urllib.request; urllib.request.urlopen('http://example.com', timeout=1)"])
def test_the_network_is_refused(sandbox: Sandbox, code: str) -> None:
    if sandbox.name == "remote":
        pytest.skip("the remote backend's network is the service's business")
    r = sandbox.run(code, LIMITS)
    assert r.status == "denied" and gone(r), r


@pytest.mark.parametrize(("code", "status"), [
    ("import sys; sys.stderr.write('MemoryError\\n'); raise ValueError('x')", "error"),
    ("import sys; sys.stderr.write('PermissionError: denied: network\\n'); sys.exit(1)",
     "error"),
    ("import sys; sys.stderr.write('MemoryError\\ndenied: x\\n')", "ok")])
def test_the_status_comes_from_how_the_tool_ended_not_from_what_it_printed(
        sandbox: Sandbox, code: str, status: str) -> None:
    assert sandbox.run(code, LIMITS).status == status


def test_output_past_the_cap_is_cut_and_the_tool_never_blocks_on_it(sandbox: Sandbox) -> None:
    limits = ToolLimits(wall_s=20.0, memory_mb=256, output_chars=100)
    r = sandbox.run("import sys\nprint('ab' * 5_000_000)\nsys.stderr.write('e' * 10**7)",
                    limits)
    assert r.status == "ok" and r.output == "ab" * 50 and gone(r)
    r = sandbox.run("print('x' * 99 + 'yz')\n1/0", limits)
    assert r.status == "error" and r.output == "ZeroDivisionError: division by zero"


def test_the_tools_environment_is_empty(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    canary = f"avrid-canary-{uuid.uuid4().hex}"
    monkeypatch.setenv("AVRID_SECRET_TOKEN", canary)
    r = sandbox.run("import os; print(sorted(os.environ.items()))", LIMITS)
    assert r.status == "ok" and canary not in r.output
    names = {name for name, _ in ast.literal_eval(r.output)}  # a list of pairs, as printed
    # What is there is the interpreter's own (PEP 538's LC_CTYPE) and bubblewrap's PWD.
    assert names <= {"LC_CTYPE", "PWD"}, names


def test_a_sibling_of_the_scratch_directory_is_outside(sandbox: Sandbox) -> None:
    if sandbox.name == "remote":
        pytest.skip("the remote backend runs on the service's machine: its files are its own")
    code = ("import os\nsibling = os.getcwd() + '-x'\n"
            "try:\n    open(sibling, 'w').write('x')\nfinally:\n    print(sibling)")
    r = sandbox.run(code, LIMITS)
    assert r.status == "denied", r
    if sandbox.name == "process":  # the directory is on this host: its sibling is too
        assert not list(Path(tempfile.gettempdir()).glob("avrid-tool-*-x"))


def test_opening_for_append_is_a_write(sandbox: Sandbox, tmp_path: Path) -> None:
    if sandbox.name == "remote":
        pytest.skip("the remote backend runs on the service's machine: its files are its own")
    if sandbox.name == "namespaces":
        # The only host files a namespaced tool sees are the runtime's: put the victim there.
        home = Path(sysconfig.get_paths()["purelib"])
    else:
        home = tmp_path
    victim = home / f"avrid-victim-{uuid.uuid4().hex}.txt"
    victim.write_text("mine")
    try:
        r = sandbox.run(f"open({str(victim)!r}, 'a').write('pwned')", LIMITS)
        assert r.status == "denied" and victim.read_text() == "mine", r
        r = sandbox.run(f"import os; os.open({str(victim)!r}, os.O_WRONLY | os.O_APPEND)",
                        LIMITS)
        assert r.status == "denied" and victim.read_text() == "mine", r
    finally:
        victim.unlink()


def test_the_run_goes_on_and_leaves_no_directory_behind(sandbox: Sandbox) -> None:
    before = tool_dirs()
    results = [sandbox.run(c, LIMITS) for c in ("print(1)", "1/0",
                                                "import os; os.makedirs('a/b/c')")]
    results.append(sandbox.run("while True: pass", ToolLimits(wall_s=1.0)))
    assert [r.status for r in results] == ["ok", "error", "ok", "timeout"]
    assert tool_dirs() <= before and all(gone(r) for r in results)


def test_run_python_uses_the_sandbox_of_the_context() -> None:
    process = process_sandbox()
    with use_sandbox(process):
        assert run_python("print(1)", LIMITS).backend == "process"
    assert run_python("print(1)", LIMITS, sandbox=process).backend == "process"


def test_a_namespaces_backend_that_cannot_start_says_why_and_never_falls_back() -> None:
    """Where bubblewrap is missing or user namespaces are refused, the backend raises with the
    reason and the alternatives, on `check` and on every call: it never runs the code in a
    weaker backend instead."""
    from avrid.agents.sandbox.namespaces import NamespaceSandbox

    for bwrap, says in (("/bin/false", "could not create its namespaces"),
                        ("/nonexistent/bwrap", "could not be started")):
        sandbox = NamespaceSandbox(bwrap=bwrap)
        with pytest.raises(SandboxUnavailable, match=says) as error:
            sandbox.check()
        assert "tools.sandbox='remote'" in str(error.value)
        assert "tools.sandbox='process' (NOT a security boundary)" in str(error.value)
        with pytest.raises(SandboxUnavailable, match=says):
            sandbox.run("print(1)", LIMITS)


def test_namespaces_run_an_interpreter_whose_environment_lies_under_tmp() -> None:
    """The sandbox mounts a fresh /tmp; a virtual environment under the host's /tmp (a CI
    checkout, a throwaway venv) must still be seen, read-only, or the call cannot start
    ("bwrap: execvp .../bin/python: No such file or directory", which made the backend
    unavailable and chapter 7's notebook fall back to the process backend)."""
    namespaces_or_skip()
    venv = Path(tempfile.mkdtemp(prefix="avrid-venv-", dir="/tmp"))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                       env=child_env(), timeout=120)
        # avrid and bubblewrap from this environment; the interpreter, its sys.prefix, the
        # one under /tmp.
        paths = os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"]])
        code = ("from avrid.agents.sandbox import ToolLimits, make_sandbox; import sys; "
                "assert sys.prefix.startswith('/tmp/'), sys.prefix; "
                "r = make_sandbox('namespaces').run('import sys; print(sys.executable)', "
                "ToolLimits(wall_s=20.0, memory_mb=256)); print(r.status, r.output.strip())")
        run = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True,
                             text=True, timeout=120, env=child_env(PYTHONPATH=paths))
        assert run.returncode == 0, run.stderr[-2000:]
        # The call ran, inside the sandbox, on the interpreter under /tmp.
        assert run.stdout.split() == ["ok", str(venv / "bin" / "python")], run.stdout
    finally:
        shutil.rmtree(venv)


def test_the_process_backend_warns_that_it_is_not_a_boundary() -> None:
    with pytest.warns(RuntimeWarning, match="NOT a security boundary"):
        ProcessSandbox()


def test_the_process_backends_cleanup_survives_what_a_tool_leaves() -> None:
    """A 1,200-deep tree (paths past PATH_MAX, deeper than the recursion limit), a directory
    without any permission, a read-only file: all removed, nothing raised."""
    before = tool_dirs()
    code = ("import os\nos.makedirs('ro/inner'); open('ro/inner/f', 'w').write('x')\n"
            "os.chmod('ro/inner/f', 0o400); os.chmod('ro/inner', 0o500); os.chmod('ro', 0)\n"
            "for _ in range(1200):\n    os.mkdir('d'); os.chdir('d')\nprint('deep')")
    r = process_sandbox().run(code, LIMITS)
    assert (r.status, r.output) == ("ok", "deep\n") and tool_dirs() <= before


def test_bad_limits_are_refused_naming_the_field() -> None:
    for field, value in (("wall_s", 0), ("memory_mb", -1), ("wall_s", float("nan")),
                         ("processes", 0), ("open_files", 3), ("scratch_mb", 1.5),
                         ("output_chars", True)):
        with pytest.raises(ValueError, match=f"ToolLimits.{field}"):
            ToolLimits(**{field: value})


def test_an_unknown_backend_or_a_remote_without_url_is_refused() -> None:
    with pytest.raises(ValueError, match="tools.sandbox must be one of"):
        make_sandbox("docker")
    with pytest.raises(ValueError, match="tools.remote_url"):
        make_sandbox("remote")



def test_quick_calls_in_a_row_all_end_ok(sandbox: Sandbox) -> None:
    """The child closes its outputs a moment before it exits: a call that finished must
    never read as a timeout (one in five did, before the parent waited for the exit)."""
    statuses = [sandbox.run("print(1)", LIMITS).status for _ in range(40)]
    assert statuses == ["ok"] * 40


def test_cleanup_reports_what_it_cannot_remove_instead_of_raising(tmp_path: Path) -> None:
    """An immutable file (a root tool can set the flag) cannot be unlinked by anyone without
    CAP_LINUX_IMMUTABLE: `remove_tree` removes everything else, names it, and returns."""
    import fcntl
    import struct

    from avrid.agents.sandbox.cleanup import remove_tree

    tree = tmp_path / "tool"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "stuck").write_text("x")
    (tree / "a" / "gone").write_text("y")
    fs_ioc_setflags, immutable = 0x40086602, 0x10
    with open(tree / "a" / "b" / "stuck") as f:
        try:
            fcntl.ioctl(f, fs_ioc_setflags, struct.pack("l", immutable))
        except OSError as e:
            pytest.skip(f"cannot make a file immutable here ({e.strerror})")
    try:
        left = remove_tree(str(tree))
        assert [entry.rsplit(":", 1)[0] for entry in left] == \
            [str(tree / "a" / "b" / "stuck"), str(tree / "a" / "b"), str(tree / "a"), str(tree)]
        assert not (tree / "a" / "gone").exists()
    finally:
        with open(tree / "a" / "b" / "stuck") as f:
            fcntl.ioctl(f, fs_ioc_setflags, struct.pack("l", 0))
    assert remove_tree(str(tree)) == [] and not tree.exists()
