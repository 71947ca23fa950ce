"""Chapter 7 — a pids cgroup per tool call, for a driver that runs as root.

The namespaces backend bounds a call's processes with RLIMIT_NPROC, counted per user
namespace. But the kernel never applies that limit to processes whose user on the host is
root (kernel/fork.c skips the check for INIT_USER), and bubblewrap maps the sandbox's user
to the user who started it: a driver running as root (common on rented GPU machines) gets
sandboxes where a fork bomb makes tens of thousands of processes in two seconds (seen here:
30,000, which took the kernel seconds to kill). For such a driver each call gets a cgroup
of its own with the pids controller (`pids.max`), which counts every task whoever owns it:

    mkdir <our cgroup>/avrid-tool-<pid>-<n>        pids.max = processes + 3
    sh -c 'echo $$ > .../cgroup.procs && exec bwrap ...'   the call starts inside it
    ... the call ...
    kill what is left, wait until it is empty, rmdir

(+3: the shell that becomes bubblewrap, bubblewrap's init, the interpreter.) The cgroup
also makes "nothing is left" checkable: it is empty before it is removed.

Both cgroup versions are handled: v1's pids hierarchy, or v2 with the pids controller
enabled for our cgroup's children. Where neither can be written, a root driver cannot bound
a call's processes, and the namespaces backend refuses to run (`SandboxUnavailable`).

Not here: the namespaces themselves (`namespaces.py`).
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import time
from pathlib import Path

_counter = itertools.count()


@functools.cache
def pids_root() -> Path | str:
    """The cgroup directory (ours) under which calls get their pids cgroups, or why none."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        own = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError as e:
        return f"cannot read this process's cgroups ({e})"
    for line in mounts:  # v1: a "cgroup" mount whose options name the pids controller
        fields = line.split()
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup" and "pids" in options:
            path = next((entry.split(":", 2)[2] for entry in own
                         if "pids" in entry.split(":", 2)[1].split(",")), "/")
            return _writable(Path(fields[4]) / path.lstrip("/"))
    for line in mounts:  # v2: the unified hierarchy, with pids enabled below our cgroup
        fields = line.split()
        sep = fields.index("-")
        if fields[sep + 1] == "cgroup2":
            path = next((entry[3:] for entry in own if entry.startswith("0::")), "/")
            base = Path(fields[4]) / path.lstrip("/")
            try:
                if "pids" not in (base / "cgroup.subtree_control").read_text().split():
                    (base / "cgroup.subtree_control").write_text("+pids")
            except OSError as e:
                return f"cannot enable the pids controller in {base} ({e.strerror})"
            return _writable(base)
    return "no cgroup hierarchy with the pids controller is mounted"


def _writable(base: Path) -> Path | str:
    probe = base / f"avrid-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"cannot create cgroups in {base} ({e.strerror})"
    return base


def make(max_pids: int) -> Path:
    """A new, empty pids cgroup allowing `max_pids` tasks (`pids_root` must be a Path)."""
    root = pids_root()
    assert isinstance(root, Path), root
    path = root / f"avrid-tool-{os.getpid()}-{next(_counter)}"
    path.mkdir()
    (path / "pids.max").write_text(str(max_pids))
    return path


def wrap(path: Path, argv: list[str]) -> list[str]:
    """`argv`, started inside cgroup `path` (a shell moves itself in, then execs it)."""
    return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(path / "cgroup.procs"),
            *argv]


def remove(path: Path, timeout_s: float = 10.0) -> None:
    """Kill whatever is left in cgroup `path`, wait until it is empty, remove it. Never
    raises: a cgroup that will not empty is left (and named by the caller's check)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pids = (path / "cgroup.procs").read_text().split()
        except OSError:
            return
        if not pids:
            try:
                path.rmdir()
            except OSError:
                pass
            return
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
