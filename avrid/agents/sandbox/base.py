"""Chapter 7 — a tool call's contract: what it may use, how it ended, and what every sandbox does.

The policy writes code nobody reviewed; a sandbox runs it and always comes back with a
`ToolResult`, within about the call's wall time, whatever the code did. Three backends
implement the `Sandbox` protocol (see `__init__.py` for which isolates what):

    namespaces   the kernel's namespaces, through bubblewrap (`namespaces.py`): the default
    remote       an HTTP code-execution service, SandboxFusion's API (`remote.py`)
    process      a child process with audit hooks (`process.py`): NOT a security boundary

Every backend runs the same small program in front of the tool's code (`boot.py`): it sets
the limits below and turns how the code ended into the process's exit status, so a status
comes from how the child ended, never from what it printed.

Not here: choosing a backend (`choose.py`), the backends themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

ToolStatus = Literal["ok", "error", "timeout", "memory", "denied", "unavailable"]
"""How a tool call ended: it finished; raised (or exited non-zero, or was killed by a
signal); ran out of wall time; ran out of memory (its code ended with MemoryError); was
refused by the sandbox (its code ended with a PermissionError, or an OSError saying the
file system is read-only or the network unreachable); or the sandbox itself could not run it
(the remote service did not answer)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolLimits:
    """What one tool call may use. Each limit is the kernel's (an rlimit, a tmpfs size) set
    before the tool's code runs; the code cannot raise it back."""

    wall_s: float = 5.0
    """Wall-clock seconds before the call is killed, with everything it started (its status
    is then "timeout"). CPU time is capped at this, rounded up, plus one second."""
    memory_mb: int = 512
    """Address space of each process of the call, MiB (RLIMIT_AS; the interpreter itself
    takes ~30). A call may hold at most `processes` x this."""
    output_chars: int = 2000
    """Characters of output (or error) kept for the observation; the rest is cut (read and
    dropped: the child never blocks on a full pipe)."""
    processes: int = 16
    """Processes (and threads) the call may run at once, its own included (RLIMIT_NPROC;
    counted per sandbox in the namespaces backend)."""
    open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    scratch_mb: int = 64
    """Size of the call's private writable directory (a tmpfs in the namespaces backend; in
    the process backend only the size of each file: RLIMIT_FSIZE)."""

    def __post_init__(self) -> None:
        value = self.wall_s
        if not (isinstance(value, int | float) and not isinstance(value, bool) and value > 0
                and math.isfinite(value)):
            raise ValueError(f"ToolLimits.wall_s must be a finite number > 0, got {value!r}")
        for name in ("memory_mb", "output_chars", "processes", "open_files", "scratch_mb"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ToolLimits.{name} must be an int >= 1, got {value!r}")
        if self.open_files < 16:  # the interpreter itself needs a few to start
            raise ValueError(f"ToolLimits.open_files must be >= 16, got {self.open_files}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolResult:
    """How one tool call ended. Example: ``ToolResult(status="ok", output="4\\n", ...)``."""

    status: ToolStatus
    output: str
    """The call's standard output when it finished, else its last error line (or what the
    sandbox says went wrong); cut to `ToolLimits.output_chars`."""
    seconds: float
    """Wall time of the call, start to the child reaped."""
    pid: int
    """The host pid of the process the call started (0 when none ran here: the remote
    backend, the calculator). Its process group is gone when the call returns."""
    backend: str = ""
    """The sandbox that ran it: "namespaces", "process", "remote" ("" for in-process tools)."""
    namespace: int | None = None
    """The namespaces backend: the inode of the call's PID namespace. Every process the call
    started was in it, and no process is when the call returns (`/proc/*/ns/pid`)."""

    def observation(self) -> str:
        """The text the environment hands back to the policy for this call."""
        if self.status == "ok":
            return self.output
        if self.status == "timeout":
            return f"[tool timed out after {self.seconds:.1f} s]"
        if self.status == "memory":
            return "[tool ran out of memory]"
        word = {"denied": "refused", "unavailable": "unavailable"}.get(self.status, "failed")
        return f"[tool {word}: {self.output}]"


class SandboxUnavailable(RuntimeError):
    """A backend cannot run on this machine (or the service cannot be reached): raised, never
    turned into an observation, and never answered by quietly using a weaker backend."""


class Sandbox(Protocol):
    """A place where a tool's Python code runs (see the module docstring)."""

    name: str
    """"namespaces", "process" or "remote": the `tools.sandbox` value that picks it."""

    def run(self, code: str, limits: ToolLimits) -> ToolResult:
        """Run `code`; always return within about `limits.wall_s` (plus the backend's own
        start-up), with nothing of the call left running. Raises only `SandboxUnavailable`."""
        ...

    def check(self) -> None:
        """Raise `SandboxUnavailable`, naming why and what to choose instead, if this backend
        cannot run here; return quietly if it can."""
        ...
