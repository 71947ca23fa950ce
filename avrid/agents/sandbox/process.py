"""Chapter 7 — the process sandbox: a child interpreter with audit hooks. NOT a security boundary.

This was chapter 7's first sandbox, and it is kept for the machines where the namespaces
backend cannot run (macOS, a container that forbids user namespaces) and for the lesson of
why it is not enough. A tool call runs in a child interpreter (``python -I``: no user site,
no PYTHON* variables, an empty environment), in a fresh temporary directory, under the same
rlimits as every backend (`boot.py`), killed with its process group at the wall time.
Before the tool's code, Python audit hooks (PEP 578) refuse the obvious: writes outside the
directory, sockets, subprocesses, ctypes.

Why it is no boundary (a red team's findings, each a one-liner for code that tries): the
hooks live in the interpreter they judge, so the code can reach their state and switch them
off (through `gc`, or by replacing `os.path.realpath`); much of the C library raises no
audit event (`_posixsubprocess.fork_exec`, `*_dir_fd=` arguments, `sqlite3.connect`,
`os.mkfifo`, hard links); nothing restricts reading (the user's files, `/proc/<ppid>/environ`,
the task's answer key); the child can signal, re-limit or write the memory of the process
that started it; a child started with `setsid` outlives the group kill. So it stops a policy
that writes outside its directory by mistake, not one that means to.

Choose it only explicitly (``tools.sandbox=process``); it warns once that it is not a
boundary. Its directory is removed however the tool left it (`cleanup.py`).

Not here: the namespaces backend, the default (`namespaces.py`).
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
import warnings

from avrid.agents.sandbox import boot
from avrid.agents.sandbox.base import ToolLimits, ToolResult
from avrid.agents.sandbox.child import run_child
from avrid.agents.sandbox.cleanup import remove_tree

# Installed in the child before the tool's code: every listed action raises an audit event
# first, and the hook raises PermissionError("denied: ...") instead of letting it happen.
AUDIT_HOOKS = r"""
def _install_hooks():
    import os, sys
    root = os.path.realpath(os.getcwd())
    network = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
               "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr"}
    processes = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                 "os.forkpty", "subprocess.Popen", "pty.spawn", "ctypes.dlopen",
                 "ctypes.dlsym", "os.kill", "os.killpg"}
    paths = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
             "os.truncate", "os.symlink", "os.link", "os.utime", "shutil.rmtree",
             "shutil.move"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def inside(path):
        if isinstance(path, int):  # an open file descriptor: it was checked when opened
            return True
        full = os.path.realpath(os.fsdecode(path))
        return full == root or full.startswith(root + os.sep)  # not a sibling "<root>-x"

    def hook(event, args):
        if event in network:
            raise PermissionError(f"denied: network access ({event})")
        if event in processes:
            raise PermissionError(f"denied: starting or signalling processes ({event})")
        if event == "open":
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(
                flags & write_flags)
            if writes and path is not None and not inside(path):
                raise PermissionError(f"denied: writing outside the tool's directory ({path})")
        elif event in paths:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise PermissionError(f"denied: {event} outside the tool's directory "
                                          f"({path})")

    sys.addaudithook(hook)

_install_hooks()
del _install_hooks
"""

WARNING = ("avrid sandbox: tools.sandbox='process' is NOT a security boundary (a tool's code "
           "can switch its audit hooks off, read your files and signal this process); use "
           "'namespaces' or 'remote' for code you do not trust")


class ProcessSandbox:
    """Tool calls in a child process with audit hooks (see the module docstring)."""

    name = "process"

    def __init__(self, *, max_concurrent: int = 64) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent!r}")
        warnings.warn(WARNING, RuntimeWarning, stacklevel=2)
        self._slots = threading.BoundedSemaphore(max_concurrent)

    def check(self) -> None:
        """Always runs (any OS with Python)."""

    def run(self, code: str, limits: ToolLimits) -> ToolResult:
        """Run `code` in a child interpreter in a fresh directory (module docstring)."""
        with self._slots:
            start = time.monotonic()
            workdir = tempfile.mkdtemp(prefix="avrid-tool-")
            try:
                argv = [sys.executable, "-I", "-S", "-c",
                        boot.program(limits, prelude=AUDIT_HOOKS, paths=boot.site_paths())]
                ended = run_child(argv, stdin=code.encode(errors="replace"),
                                  wall_s=limits.wall_s, cap=4 * limits.output_chars, env={},
                                  cwd=workdir)
            finally:
                left = remove_tree(workdir)
            if left:
                warnings.warn(f"avrid sandbox: could not remove all of {workdir}: "
                              f"{left[0]} (and {len(left) - 1} more)", RuntimeWarning,
                              stacklevel=2)
            seconds = time.monotonic() - start
        status, text = boot.outcome(ended.returncode, ended.stdout.decode(errors="replace"),
                                    ended.stderr.decode(errors="replace"))
        return ToolResult(status=status, output=text[:limits.output_chars], seconds=seconds,
                          pid=ended.pid, backend=self.name)
