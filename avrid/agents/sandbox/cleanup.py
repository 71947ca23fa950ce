"""Chapter 7 — removing a tool's directory, however the tool left it, without ever raising.

The process backend gives each call a directory on the host and removes it afterwards. A
tool can leave there whatever it likes: a tree 1,200 directories deep (``shutil.rmtree``
recurses, so it raised RecursionError in the caller, and the paths pass PATH_MAX), read-only
directories (nothing inside can be unlinked), symlinks to the user's files (which must not be
followed), files it made immutable. `remove_tree` walks the tree with one open directory at a
time, relative to it (never a long path, never a symlink followed), makes each directory
writable before emptying it, and carries on past what it cannot remove, returning what is
left instead of raising: cleanup after a tool call must never be what stops a run.

The namespaces backend needs none of this: its scratch directory is a tmpfs the kernel frees
with the sandbox.

Not here: the backends.
"""

from __future__ import annotations

import os
import stat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def remove_tree(path: str) -> list[str]:
    """Remove `path` (a directory this process created) and everything under it; return
    "name: reason" for each entry that could not be removed (empty when all went).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); os.makedirs(os.path.join(d, "a", "b")); remove_tree(d)
        []
        >>> os.path.exists(d)
        False
    """
    left: list[str] = []
    try:
        fd = os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        return left
    except OSError as e:
        return [f"{path}: {e.strerror}"]
    names: list[str] = []  # the directories entered below `path`, outermost first
    skipped: set[tuple[int, int]] = set()  # entries that failed: never retried
    while True:
        entry = _next_entry(fd, skipped)
        if entry is not None:
            name, is_dir, key = entry
            if is_dir:
                child = _enter(fd, name, left, names)
                if child is None:
                    skipped.add(key)
                else:
                    os.close(fd)
                    fd = child
                    names.append(name)
                continue
            try:
                os.unlink(name, dir_fd=fd)
            except OSError as e:
                skipped.add(key)
                left.append(f"{os.path.join(path, *names, name)}: {e.strerror}")
            continue
        # This directory holds nothing we can remove any more: leave it for its parent.
        if not names:
            os.close(fd)
            try:
                os.rmdir(path)
            except OSError as e:
                left.append(f"{path}: {e.strerror}")
            return left
        name = names.pop()
        parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
        st = os.fstat(fd)
        os.close(fd)
        fd = parent
        try:
            os.rmdir(name, dir_fd=fd)
        except OSError as e:
            skipped.add((st.st_dev, st.st_ino))
            left.append(f"{os.path.join(path, *names, name)}: {e.strerror}")


def _next_entry(fd: int, skipped: set[tuple[int, int]]) -> tuple[str, bool, tuple[int, int]] | None:
    """The first entry of directory `fd` not yet skipped: (name, is a real directory, key)."""
    try:
        with os.scandir(fd) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                key = (st.st_dev, st.st_ino)
                if key not in skipped:
                    return entry.name, stat.S_ISDIR(st.st_mode), key
    except OSError:
        return None
    return None


def _enter(fd: int, name: str, left: list[str], names: list[str]) -> int | None:
    """Open subdirectory `name` of `fd` (made readable, writable and searchable first, so
    its entries can be listed and unlinked); None, noted in `left`, if that fails."""
    try:
        child = os.open(name, _DIR_FLAGS, dir_fd=fd)
        os.fchmod(child, stat.S_IRWXU)
        return child
    except OSError:
        try:  # a directory without read or search permission cannot be opened: chmod first
            os.chmod(name, stat.S_IRWXU, dir_fd=fd)
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            return child
        except (OSError, NotImplementedError) as e:
            left.append(f"{os.path.join(*names, name)}: {getattr(e, 'strerror', e)}")
            return None
