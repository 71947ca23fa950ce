"""Chapter 7 — one child process, started, fed, read and ended within a deadline.

Both local backends start a child (bubblewrap, or the interpreter itself), write the tool's
code to its standard input, read what it prints, and must come back by the wall time
whatever the child does. `run_child` does that with one `selectors` loop:

- the code goes in through a non-blocking pipe (a child that never reads it cannot block us);
- standard output keeps its first `cap` bytes, standard error its last `cap` (where the
  exception is); the rest is read and dropped, so a child printing without end neither
  blocks on a full pipe nor fills the parent's memory;
- the child's exit is watched through a pidfd; at the deadline (or once it has exited)
  its whole process group is killed, and the parent waits for it: no zombie, no leftover in
  its group.

Not here: what the child is (the backends), what its exit status means (`boot.py`).
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

_GRACE_S = 0.5
"""After the child exits, how long its pipes may stay open (held by something it started
that is not yet dead) before the parent stops reading."""


@dataclass(frozen=True, slots=True)
class Ended:
    """How a child ended: `returncode` None if it was killed at the deadline."""

    returncode: int | None
    stdout: bytes
    stderr: bytes
    pid: int


def run_child(argv: Sequence[str], *, stdin: bytes, wall_s: float, cap: int,
              env: dict[str, str], cwd: str | None = None,
              pass_fds: Sequence[int] = ()) -> Ended:
    """Run `argv` in a session of its own with `stdin` as its input; return within about
    `wall_s` seconds (see the module docstring)."""
    proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=cwd, pass_fds=tuple(pass_fds),
                            start_new_session=True)
    try:
        out, err, exited = _pump(proc, stdin, time.monotonic() + wall_s, cap)
    finally:
        kill_group(proc.pid)  # the child and whatever it left in its group
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()
    return Ended(returncode=proc.returncode if exited else None, stdout=out, stderr=err,
                 pid=proc.pid)


def _pump(proc: subprocess.Popen[bytes], data: bytes, deadline: float,
          cap: int) -> tuple[bytes, bytes, bool]:
    """Write `data`, read both outputs, until they close after the child's exit or the
    deadline passes; returns (stdout head, stderr tail, whether the child exited)."""
    assert proc.stdin and proc.stdout and proc.stderr
    sel = selectors.DefaultSelector()
    pidfd = _pidfd(proc.pid)
    try:
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            os.set_blocking(pipe.fileno(), False)
        if data:
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ)
        out, err, sent, exited = b"", b"", 0, False
        open_outputs = 2
        while open_outputs and (left := deadline - time.monotonic()) > 0:
            # Without a pidfd (not Linux) the exit is polled, at most 20 times a second.
            events = sel.select(timeout=left if pidfd is not None else min(left, 0.05))
            for key, _ in events:
                if key.fileobj is proc.stdin:
                    try:
                        sent += os.write(proc.stdin.fileno(), data[sent:sent + 65536])
                    except BrokenPipeError:  # it stopped reading: fine, it got what it read
                        sent = len(data)
                    if sent >= len(data):
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                elif key.fileobj is pidfd:
                    sel.unregister(pidfd)
                else:
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        open_outputs -= 1
                    elif key.fileobj is proc.stdout:
                        out = out if len(out) >= cap else (out + chunk)[:cap]
                    else:
                        err = (err + chunk)[-cap:]
            if not exited and proc.poll() is not None:
                exited = True  # what still holds the pipes gets a moment, then is ignored
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        if not exited:  # both outputs closed: the child is ending; give it until the deadline
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                exited = True
            except subprocess.TimeoutExpired:
                pass
        return out, err, exited
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)


def _pidfd(pid: int) -> int | None:
    """A file descriptor that becomes readable when `pid` exits (Linux >= 5.3), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def kill_group(pgid: int) -> None:
    """SIGKILL every process of group `pgid`; nothing if none is left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # already gone (or a reused id)
        pass
