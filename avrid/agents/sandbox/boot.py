"""Chapter 7 — the program that runs in front of a tool's code, in every sandbox backend.

The child interpreter runs this first (``python -I -c PROGRAM``, or as the file a remote
service runs): it lowers its own limits (a process may lower its rlimits, never raise them
back), runs the tool's code, and turns how the code ended into its exit status:

    0      the code finished (or called sys.exit(0))
    81     it ended with MemoryError                      -> status "memory"
    82     it ended with a refusal: PermissionError, or   -> status "denied"
           OSError EROFS/EPERM/EACCES/ENETUNREACH, or a failed name lookup (a write outside
           the scratch directory, the network that is not there; urllib's URLError is
           judged by the error it wraps)
    1      it ended with any other exception (its "Type: message" is the last line of
           standard error, which becomes the observation)          -> status "error"
    other  its own sys.exit(n) / os._exit(n); a signal kills it    -> status "error"

The parent reads the status from the exit code alone (`status_of`): a tool that prints
"MemoryError" or "denied" to standard error is still an error (or ok). The code can of
course end itself any way it likes; what it cannot do is make a status out of text.

This is not a boundary: the program runs in the same interpreter as the code it starts, so
the code can undo anything here except the rlimits. The boundary is the backend around it.

Not here: how the child is started and isolated (the backends).
"""

from __future__ import annotations

import functools
import math
import os
import signal
import sysconfig

from avrid.agents.sandbox.base import ToolLimits, ToolStatus

EXIT_MEMORY = 81
EXIT_DENIED = 82
# Python itself exits with 120 when flushing stdout fails at shutdown, and 1 for an
# uncaught exception: neither may be taken for a refusal, hence codes of our own.

_BODY = r"""
import errno as _errno, os as _os, resource as _resource, sys as _sys
_sys.path.extend(PATHS)
for _name, _value in LIMITS:
    _resource.setrlimit(getattr(_resource, _name), (_value, _value))
if CODE is None:
    CODE = _sys.stdin.read()
_sys.stdin = open(_os.devnull)  # the code's own input() reads nothing, never the parent
_status = 0
try:
    exec(compile(CODE, "<tool>", "exec"), {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException as _e:
    try:  # traceback is imported only here: it costs ~13 ms of every call's start
        import traceback as _tb
        _line = "".join(_tb.format_exception_only(type(_e), _e)).strip().splitlines()[-1]
    except BaseException:  # formatting may itself run out of memory
        _line = type(_e).__name__
    _sys.stderr.write("\n" + _line + "\n")
    _cause = getattr(_e, "reason", None)  # urllib wraps the socket's error in URLError
    _cause = _cause if isinstance(_cause, OSError) else _e
    _socket = _sys.modules.get("socket")
    _refused = isinstance(_cause, PermissionError) or (
        isinstance(_cause, OSError) and _cause.errno in (
            _errno.EROFS, _errno.EPERM, _errno.EACCES, _errno.ENETUNREACH)) or (
        _socket is not None and isinstance(_cause, _socket.gaierror))
    _status = 81 if isinstance(_e, MemoryError) else 82 if _refused else 1
_sys.exit(_status)
"""


def rlimits(limits: ToolLimits) -> tuple[tuple[str, int], ...]:
    """The rlimits the child sets on itself, by `resource` name."""
    return (("RLIMIT_AS", limits.memory_mb << 20),
            ("RLIMIT_CPU", math.ceil(limits.wall_s) + 1),
            ("RLIMIT_FSIZE", limits.scratch_mb << 20),
            ("RLIMIT_NOFILE", limits.open_files),
            ("RLIMIT_NPROC", limits.processes),
            ("RLIMIT_CORE", 0))


@functools.cache
def site_paths() -> tuple[str, ...]:
    """This interpreter's site-packages directories. A local child starts with ``-S`` (no
    `site`: it saves ~45 ms a call, most of it .pth hooks such as an editable install's)
    and gets these on its path instead, so the packages installed here import there."""
    paths = sysconfig.get_paths()
    return tuple(dict.fromkeys(p for p in (paths["purelib"], paths["platlib"])
                               if os.path.isdir(p)))


def program(limits: ToolLimits, *, code: str | None = None, prelude: str = "",
            paths: tuple[str, ...] = ()) -> str:
    """The child's program: the limits, `paths` added to `sys.path` (`site_paths`, for a
    child started with ``-S``), `prelude` (the process backend's audit hooks), then the
    tool's `code`, embedded (a remote service gets one file) or None: read from stdin.

    Example:
        >>> "RLIMIT_AS" in program(ToolLimits(memory_mb=64), code="print(1)")
        True
    """
    head = f"LIMITS = {rlimits(limits)!r}\nCODE = {code!r}\nPATHS = {list(paths)!r}\n"
    return head + prelude + _BODY


def status_of(returncode: int) -> ToolStatus:
    """The status of a child that ended with `returncode` (negative: killed by that signal).

    Example:
        >>> status_of(0), status_of(81), status_of(1), status_of(-9)
        ('ok', 'memory', 'error', 'error')
    """
    if returncode == 0:
        return "ok"
    return {EXIT_MEMORY: "memory", EXIT_DENIED: "denied"}.get(returncode, "error")


def error_text(returncode: int, stderr: str) -> str:
    """What the observation says of a child that did not end with 0: the last line of its
    standard error (the program above writes the exception there last), or how it ended."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines and returncode in (1, EXIT_MEMORY, EXIT_DENIED) else \
        f"exit status {returncode}"


def outcome(returncode: int | None, stdout: str, stderr: str) -> tuple[ToolStatus, str]:
    """(status, text) of a child that ended with `returncode` (None: killed at its wall
    time): its output when it finished, else what `error_text` says.

    Example:
        >>> outcome(0, "4", ""), outcome(None, "", "")
        (('ok', '4'), ('timeout', ''))
        >>> outcome(1, "", "Traceback ...\\nZeroDivisionError: x")
        ('error', 'ZeroDivisionError: x')
    """
    if returncode is None:
        return "timeout", ""
    status = status_of(returncode)
    return status, stdout if status == "ok" else error_text(returncode, stderr)
