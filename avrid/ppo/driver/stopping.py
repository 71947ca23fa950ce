"""Chapter 5 — stopping a run the way a batch scheduler expects: Ctrl-C and SIGTERM alike.

A person stops a run with Ctrl-C (SIGINT); SLURM and Kubernetes stop a job with SIGTERM, then
SIGKILL after a grace period. `avrid ppo` treats the two alike (`StopSignals`): the first one
raises `KeyboardInterrupt` in the main thread, so the run stops at once and every ``with``
block on the way out closes (the workers, the logs, the output directory's lock); the command
then says whether there is a checkpoint to resume from and exits 128 + the signal's number
(130 for SIGINT, 143 for SIGTERM), as shells and schedulers read it. Any later signal is
ignored until the block ends, so that a second Ctrl-C cannot cut the cleanup short (it used to
print a traceback from Ray's exit hook and leave ``ray::`` processes running for minutes).

Ray's start (``ray.init``) sets SIGTERM handlers of its own, whatever was there: a Python one
and, in its C++ core, one that prints a native stack dump and aborts (exit 134).
`keep_own_sigterm` puts back a handler the process had set itself (`StopSignals`', a user's);
a process that had none keeps Ray's.

Signal handlers belong to a process, and avrid is a guest in its caller's: `StopSignals` is
for the command, which owns its process, and puts the previous handlers back when its block
ends. Handlers can only be set from the main thread; elsewhere both are no-ops. What stopping
does — closing the workers, releasing the lock — is the trainer's and `run.train`'s.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a run: Ctrl-C, and what a scheduler sends."""


class StopSignals:
    """While the block runs, SIGINT and SIGTERM stop it with `KeyboardInterrupt`; the first
    one's number is kept in `signum`, and later ones are ignored (the cleanup runs to its end).

    Example (what ``avrid ppo`` does)::

        with StopSignals() as stop:
            try:
                train(config)
            except KeyboardInterrupt:
                sys.exit(128 + stop.signum)   # 130 after Ctrl-C, 143 after SIGTERM
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        """The first stop signal received, None while there was none."""
        self._ignoring = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                self._previous[number] = signal.signal(number, self._on_signal)
        return self

    def _on_signal(self, number: int, frame: FrameType | None) -> None:
        if self._ignoring:
            return  # already stopping: the cleanup under way must finish
        self.signum, self._ignoring = number, True
        raise KeyboardInterrupt(signal.Signals(number).name)

    def ignore(self) -> None:
        """From now on, ignore the first stop signal too: call it before a cleanup that no
        signal may cut short (shutting Ray down at the end of a run)."""
        self._ignoring = True

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for number, handler in self._previous.items():
            # None: a handler set outside Python; the default is the closest Python can set.
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
        self._previous = {}


@contextmanager
def keep_own_sigterm() -> Iterator[None]:
    """Run the block (Ray's start) and put back the SIGTERM handler the process had set itself,
    if any (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    own = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(own):  # SIG_DFL, SIG_IGN and None (set outside Python) are not
            signal.signal(signal.SIGTERM, own)
