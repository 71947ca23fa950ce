"""Chapter 7 — a seccomp filter for the namespaces backend: system calls a tool never needs.

Namespaces decide what a tool can *see*; the kernel's own code is still reachable through
every system call. A seccomp filter, installed by bubblewrap before the tool's interpreter
starts and inherited by everything it starts, answers EPERM to the calls below instead of
running them. None of them is needed by Python code computing an answer; each has been the
way in for escapes or kernel exploits, or reaches past the namespaces:

    ptrace, process_vm_readv/writev     read or write another process's memory
    kexec_*, reboot, *_module, swapon/off, acct, syslog, quotactl,
    settimeofday, clock_settime/adjtime, adjtimex         the machine itself
    mount, umount2, pivot_root, move_mount, open_tree, fsopen, fsmount, fsconfig,
    fspick, mount_setattr                                  the file system view
    unshare, setns                       new or other namespaces (bubblewrap's
                                         --disable-userns closes user namespaces as well)
    keyctl, add_key, request_key         the kernel keyring (not namespaced)
    bpf, perf_event_open, userfaultfd, io_uring_*          large attack surfaces
    open_by_handle_at, name_to_handle_at                   files by handle, past mounts
    personality, lookup_dcookie, vhangup, iopl, ioperm     old or hardware-level calls

The filter is built once per process with libseccomp (through `pyseccomp`, a ctypes
binding) for the machine's architecture, and handed to bubblewrap as a file descriptor.
Without libseccomp the backend still isolates by namespaces; it says so once (`available`).

Not here: the namespaces themselves (`namespaces.py`).
"""

from __future__ import annotations

import errno
import functools
import os

BLOCKED = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "kexec_load", "kexec_file_load", "reboot", "init_module", "finit_module",
    "delete_module", "swapon", "swapoff", "acct", "syslog", "quotactl", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex",
    "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsmount",
    "fsconfig", "fspick", "mount_setattr",
    "unshare", "setns",
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register",
    "open_by_handle_at", "name_to_handle_at",
    "personality", "lookup_dcookie", "vhangup", "iopl", "ioperm",
)
"""The system calls answered with EPERM (see the module docstring)."""


@functools.cache
def _program() -> bytes | str:
    """The compiled filter (BPF bytes), or why there is none (a str)."""
    try:
        import pyseccomp
    except (ImportError, OSError) as e:  # OSError: libseccomp.so itself is missing
        return f"pyseccomp/libseccomp unavailable ({type(e).__name__}: {e})"
    flt = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in BLOCKED:
        try:
            flt.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
        except (ValueError, OSError):  # a call this architecture does not have (iopl on arm)
            continue
    fd = os.memfd_create("avrid-seccomp")
    try:
        with os.fdopen(os.dup(fd), "wb", buffering=0) as f:
            flt.export_bpf(f)
        os.lseek(fd, 0, os.SEEK_SET)
        size = os.fstat(fd).st_size
        return os.read(fd, size)
    finally:
        os.close(fd)


def available() -> str | None:
    """None when the filter can be built here, else why not."""
    program = _program()
    return program if isinstance(program, str) else None


def filter_fd() -> int | None:
    """A fresh file descriptor holding the filter, positioned at its start (bubblewrap reads
    it to the end: one per sandbox), or None without libseccomp. The caller closes it."""
    program = _program()
    if isinstance(program, str):
        return None
    fd = os.memfd_create("avrid-seccomp")
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
