"""Chapter 5 — a run's output directory: one run at a time, checked before it starts,
written atomically, and write errors that name the file.

A training run can take days, and its output directory (``train.out_dir``) is the only copy
of what it produced. Four things keep it safe:

- `OutDirLock` takes an exclusive lock on the directory for the run's lifetime: a lock file
  ``out_dir/.avrid.lock`` held with ``flock``, holding the owner's pid and host. A second run
  on the same directory is refused at start, naming the directory and the holder. The kernel
  drops the lock when the process ends, however it ends (SIGKILL, OOM, power loss), so a
  crashed run never leaves a stale lock behind; the file itself stays (deleting it would race
  with a run that is opening it) and means nothing while nobody holds it.
- `preflight` checks, before any worker starts, that the directories the run will write to
  can be written, so an unwritable ``checkpoints/`` fails in the first second, not after
  three days at the first save.
- files and directories are published atomically (`write_file`, `fsync_dir`,
  `move_into_place`: written under a temporary name, fsynced, renamed into place), so a crash
  leaves the old version or the new one, never half of one; what a killed writer leaves
  behind is removed by the next run at start (`remove_stale_temp_dirs`, under the lock).
- `writing(path)` turns an I/O failure into a `WriteError` (an `OSError`) whose message is
  ``could not write <path>: <cause>``; a full disk says "No space left on device" even where
  the writer only said ``basic_ios::clear: iostream error`` (torch.save): a write that fails
  without an errno on a file system with less than `LOW_SPACE_BYTES` free is taken for one.

The lock is advisory and POSIX-only (``fcntl``): it stops other avrid runs, not ``rm``. On
network file systems it is as good as their ``flock`` (NFSv4 maps it to a lease). This file
knows nothing about checkpoints or metrics: `checkpoint.py` and `export.py` use its
publishing steps, and `run.py` decides what a directory may hold.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

LOCK_FILE = ".avrid.lock"
"""Name of the lock file inside the output directory."""
STALE_PREFIXES = (".tmp-", ".trash-")
"""Hidden directories that `move_into_place` and its callers make and remove; one still
there while nobody holds the directory's lock was left by a killed process."""
LOW_SPACE_BYTES = 64 * 2**20
"""A failed write on a file system with less free space than this is reported as a full
disk: torch.save's error on ENOSPC carries no errno, only ``iostream error``."""


class OutDirError(ValueError):
    """The output directory cannot be used as asked (busy, no checkpoint to resume, earlier
    outputs in the way); the message says why and what to do instead."""


class OutDirBusyError(OutDirError):
    """Another live process holds the output directory's lock."""


class WriteError(OSError):
    """Writing `path` failed; the message is ``could not write <path>: <cause>``.

    `errno` is the cause's (ENOSPC for a full disk, also when the writer did not say so);
    `__cause__` keeps the original exception.
    """

    def __init__(self, path: str | os.PathLike[str], cause: BaseException) -> None:
        self.path = Path(path)
        full = _is_disk_full(cause, self.path)
        super().__init__(f"could not write {self.path}: {_describe(cause, full)}")
        # Not `filename`/`strerror`: OSError would then print "[Errno n] ..." instead.
        self.errno = errno.ENOSPC if full else getattr(cause, "errno", None)


@contextmanager
def writing(path: str | os.PathLike[str],
            errors: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Run the enclosed writes of `path`; an OSError or RuntimeError (and any of `errors`,
    e.g. a library's own I/O error type) becomes a `WriteError` naming `path`.

    Example:
        >>> try:
        ...     with writing("/nonexistent/dir/metrics.jsonl"):
        ...         open("/nonexistent/dir/metrics.jsonl", "w")
        ... except WriteError as e:
        ...     print(e)
        could not write /nonexistent/dir/metrics.jsonl: No such file or directory
    """
    try:
        yield
    except WriteError:
        raise  # already names its file
    except (OSError, RuntimeError, *errors) as e:
        raise WriteError(path, e) from e


def preflight(*directories: str | os.PathLike[str]) -> None:
    """Check now that each directory can be written: create and remove a probe file in it,
    or, for one that does not exist yet, in its nearest existing parent (nothing is created).

    Raises:
        WriteError: naming the directory and the cause (permission denied, read-only file
            system, a file where a directory should be, no space left, ...).
    """
    for d in map(Path, directories):
        target = d
        while not target.exists() and target != target.parent:
            target = target.parent
        with writing(d):
            if not target.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, f"{target} exists and is not a "
                                         "directory")
            fd, probe = tempfile.mkstemp(dir=target, prefix=".avrid-probe-", suffix=".tmp")
            os.close(fd)
            os.unlink(probe)


class OutDirLock:
    """An exclusive lock on an output directory, held from `acquire` until `release` (or
    until the process ends). Use as a context manager; the directory is created if needed.

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> with OutDirLock(tmp.name):
        ...     try:
        ...         OutDirLock(tmp.name).acquire()
        ...     except OutDirBusyError as e:
        ...         print("refused:", "is in use by another run" in str(e))
        refused: True
        >>> tmp.cleanup()
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> OutDirLock:
        """Take the lock or raise `OutDirBusyError` naming the directory and the holder."""
        if self._fd is not None:
            return self
        with writing(self.path):
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutDirBusyError(
                f"output directory {self.directory} is in use by another run "
                f"({_holder(self.path)}); two runs writing one directory would mix their "
                f"metrics and checkpoints. Wait for it to finish, stop it, or write to "
                f"another directory (--out, i.e. train.out_dir)") from None
        except BaseException:
            os.close(fd)
            raise
        # Who holds it, for the message a second run prints; rewritten in place (the lock
        # belongs to this open file, so the file must not be replaced).
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            with writing(self.path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        except BaseException:
            os.close(fd)  # closing the file releases the lock
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (closing the file does it); safe to call twice."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OutDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# ---- publishing files and directories atomically ----------------------------------------------

def write_file(path: Path, write: Callable[[Path], object]) -> None:
    """Run `write(path)`, then fsync the file so the rename that follows publishes data that
    is on disk, not just in the page cache. An I/O failure (a full disk, a permission)
    raises `WriteError` naming `path` and the cause."""
    with writing(path, errors=(SafetensorError,)):  # safetensors' I/O error is its own type
        write(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable (POSIX); a no-op where directories cannot be
    opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def move_into_place(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`. An existing `final` (e.g. a checkpoint step saved again after
    a resume) is first renamed into a ``.trash-<name>-*`` directory and deleted only once the
    new one is in place; after a crash in between, `remove_stale_temp_dirs` puts it back."""
    if not final.exists():
        os.rename(tmp, final)
        return
    trash = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".trash-{final.name}-"))
    try:
        os.rename(final, trash / final.name)
    except BaseException:  # `final` could not be set aside (busy, a mount point): no trash
        os.rmdir(trash)
        raise
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(trash / final.name, final)  # put the old one back; the caller drops tmp
        shutil.rmtree(trash, ignore_errors=True)
        raise
    shutil.rmtree(trash, ignore_errors=True)


def remove_stale_temp_dirs(directory: str | os.PathLike[str]) -> list[Path]:
    """Clean up after writers that were killed in `directory`: delete ``.tmp-*`` directories
    (a save or export never published) and hidden ``*.tmp`` files (an atomic file write),
    and empty ``.trash-*`` directories, first putting back a version that `move_into_place`
    had set aside when its replacement never arrived. Returns what was removed.

    Call it only while no other process can be writing there, e.g. holding the directory's
    `OutDirLock`: a live writer's temporary directory looks the same as a dead one's.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for p in sorted(directory.iterdir()):
        if p.is_symlink() or not p.name.startswith("."):
            continue
        if p.is_dir() and p.name.startswith(STALE_PREFIXES):
            for old in p.iterdir() if p.name.startswith(".trash-") else ():
                if not (directory / old.name).exists():
                    os.rename(old, directory / old.name)
            shutil.rmtree(p)
        elif p.is_file() and p.name.endswith(".tmp"):
            p.unlink()
        else:
            continue
        removed.append(p)
    return removed


def _holder(path: Path) -> str:
    """"pid N on HOST since T" from the lock file, as far as it can be read."""
    try:
        info = json.loads(path.read_text())
        return f"pid {info['pid']} on {info['host']} since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet"


def _is_disk_full(cause: BaseException, path: Path) -> bool:
    if getattr(cause, "errno", None) == errno.ENOSPC or "no space left" in str(cause).lower():
        return True
    if isinstance(cause, OSError) and cause.errno is not None:
        return False  # a specific error (permission, read-only, ...) that is not ENOSPC
    return _free_bytes(path) < LOW_SPACE_BYTES


def _free_bytes(path: Path) -> float:
    """Free bytes on the file system of `path` (its nearest existing parent); inf if unknown."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return float("inf")


def _describe(cause: BaseException, full: bool) -> str:
    if full:
        return os.strerror(errno.ENOSPC)  # "No space left on device", as the OS words it
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    return str(cause) or type(cause).__name__
