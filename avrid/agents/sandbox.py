"""Chapter 7 — tools in a sandbox: the code of a tool call run in a child process, under limits.

A multi-turn episode lets the policy call tools: a calculator, a Python interpreter. What
the policy writes is code nobody reviewed, so it runs in a process of its own, and whatever
it does comes back as an observation — the output, the error, "timed out" — while the run
goes on. The limits, and what enforces each:

    wall time     the parent waits `wall_s`, then kills the child's whole process group
                  (it runs in a session of its own); CPU time is capped too (RLIMIT_CPU)
    memory        RLIMIT_AS: an allocation past `memory_mb` raises MemoryError in the child
    disk          the child starts in a fresh temporary directory (removed afterwards);
                  opening a file for writing, removing or renaming anything outside it is
                  refused; output files are capped (RLIMIT_FSIZE)
    network       refused: socket connects, binds, sends and name lookups
    processes     refused: no subprocess, fork, exec or os.system; no ctypes

The refusals are Python audit hooks (PEP 578) installed in the child before the tool's code
runs: every one of those actions raises an audit event first, and the hook raises
`PermissionError("denied: ...")` instead of letting it happen. That stops what a policy
model does by mistake or by reward hacking in Python; it is not a boundary against code
built to escape (a C extension could bypass the hooks): for adversarial code, run the tool
in a container. The child also runs isolated (``python -I``: no user site, no PYTHON*
variables, the script's directory not on the path) with an empty environment.

Not here: parsing a tool call out of the policy's tokens, the episode loop (later files of
chapter 7). Standard library only.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

ToolStatus = Literal["ok", "error", "timeout", "memory", "denied"]
"""How a tool call ended: it finished, raised, ran out of time or memory, or was refused."""

_FILE_BYTES = 1 << 20
"""RLIMIT_FSIZE of the child: no file it writes (its output included) grows past 1 MiB."""

# Runs in the child (``python -I -c``) before the tool's code, which it reads from stdin.
# Limits first (a process may lower its own), then the audit hook, then the code.
_BOOT = r"""
import os, resource, sys
memory, cpu, fsize = (int(a) for a in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
ROOT = os.path.realpath(os.getcwd())
CODE = sys.stdin.read()
NETWORK = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
           "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr"}
PROCESSES = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
             "subprocess.Popen", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "os.kill",
             "os.killpg"}
PATHS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
         "os.truncate", "os.symlink", "os.link", "os.utime", "shutil.rmtree", "shutil.move"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def inside(path):
    if isinstance(path, int):  # an open file descriptor: it was checked when opened
        return True
    full = os.path.realpath(os.fsdecode(path))
    return full == ROOT or full.startswith(ROOT + os.sep)

def hook(event, args):
    if event in NETWORK:
        raise PermissionError(f"denied: network access ({event})")
    if event in PROCESSES:
        raise PermissionError(f"denied: starting or signalling processes ({event})")
    if event == "open":
        path, mode, flags = args
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(
            flags & WRITE_FLAGS)
        if writes and path is not None and not inside(path):
            raise PermissionError(f"denied: writing outside the tool's directory ({path})")
    elif event in PATHS:
        for path in args[:2]:
            if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                raise PermissionError(f"denied: {event} outside the tool's directory ({path})")

sys.addaudithook(hook)
del hook
exec(compile(CODE, "<tool>", "exec"), {"__name__": "__main__"})
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolLimits:
    """What one tool call may use."""

    wall_s: float = 5.0
    """Wall-clock seconds before the call is killed (its status is then "timeout")."""
    memory_mb: int = 512
    """Address space of the child, MiB (RLIMIT_AS: the interpreter itself takes ~30)."""
    output_chars: int = 2000
    """Characters of output (or error) kept for the observation; the rest is cut."""

    def __post_init__(self) -> None:
        for name in ("wall_s", "memory_mb", "output_chars"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"ToolLimits.{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolResult:
    """How one tool call ended. Example: ``ToolResult(status="ok", output="4\\n", ...)``."""

    status: ToolStatus
    output: str
    """The call's standard output when it finished, else its last error line; cut to
    `ToolLimits.output_chars`."""
    seconds: float
    """Wall time of the call, start to the child reaped."""
    pid: int
    """The child's pid, which is also its process group: gone when `run_python` returns."""

    def observation(self) -> str:
        """The text the environment hands back to the policy for this call."""
        if self.status == "ok":
            return self.output
        if self.status == "timeout":
            return f"[tool timed out after {self.seconds:.1f} s]"
        if self.status == "memory":
            return "[tool ran out of memory]"
        return f"[tool {'refused' if self.status == 'denied' else 'failed'}: {self.output}]"


def run_python(code: str, limits: ToolLimits | None = None) -> ToolResult:
    """Run `code` (Python source) in a sandboxed child process; always returns, within about
    `limits.wall_s`, with nothing of the child left running and its directory removed."""
    limits = limits or ToolLimits()
    workdir = tempfile.mkdtemp(prefix="avrid-tool-")
    start = time.monotonic()
    try:
        with open(os.path.join(workdir, ".stdout"), "w+b") as out, \
                open(os.path.join(workdir, ".stderr"), "w+b") as err:
            status, pid = _run(code, limits, workdir, out, err)
            out.seek(0)
            err.seek(0)
            stdout = out.read(4 * limits.output_chars).decode(errors="replace")
            stderr = err.read().decode(errors="replace")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    seconds = time.monotonic() - start
    if status == "exited 0":
        status, text = "ok", stdout
    elif status.startswith("exited"):
        status, text = _classify(stderr, code=int(status.split()[1]))
    elif status.startswith("signal"):
        status, text = "error", f"killed by {status.split()[1]}"
    else:
        text = ""
    return ToolResult(status=status, output=text[: limits.output_chars], seconds=seconds, pid=pid)


def _run(code: str, limits: ToolLimits, workdir: str, out, err) -> tuple[str, int]:  # noqa: ANN001
    """Start the child, feed it `code`, wait; ("exited N" | "signal NAME" | "timeout", pid)."""
    argv = [sys.executable, "-I", "-c", _BOOT, str(limits.memory_mb << 20),
            str(math.ceil(limits.wall_s) + 1), str(_FILE_BYTES)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=workdir,
                            env={}, start_new_session=True)
    try:
        proc.communicate(code.encode(), timeout=limits.wall_s)
        outcome = (f"exited {proc.returncode}" if proc.returncode >= 0
                   else f"signal {signal.Signals(-proc.returncode).name}")
    except subprocess.TimeoutExpired:
        outcome = "timeout"
    finally:
        _kill_group(proc.pid)  # the child and anything it left behind
        proc.wait()
    return outcome, proc.pid


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass


def _classify(stderr: str, *, code: int) -> tuple[ToolStatus, str]:
    """The status and message of a child that exited with status `code` != 0, from the last
    line of its standard error (an uncaught exception's "Type: message")."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit status {code}"
    if last.startswith("MemoryError"):
        return "memory", last
    if "denied: " in last:  # the audit hook's refusal, raised as is or wrapped (urllib's)
        return "denied", last.removeprefix("PermissionError: ")
    return "error", last
