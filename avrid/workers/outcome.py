"""Chapter 1 — outcomes of a call: a method's value, or its failure carried as a value.

The in-process backend runs a worker's method (or constructor) through `capture`, which turns
any exception into a `CallFailure` holding the formatted traceback, so that a failure on one
rank can be reported the same way whichever backend ran it: one `WorkerError` naming role, rank,
method and the remote traceback (`check_outcome`). The Ray backend gets the same
information from Ray's own error types and builds the same `WorkerError` (`ray_backend.py`).

Also `free_port`, used to pick a rendezvous port. Nothing here imports Ray or torch.
"""

from __future__ import annotations

import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from avrid.workers.errors import WorkerError
from avrid.workers.identity import WorkerIdentity


@dataclass(frozen=True, slots=True, kw_only=True)
class CallFailure:
    """What `capture` returns instead of raising: the exception's type and traceback."""

    exc_type: str
    traceback: str


def capture(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, with an exception returned as a `CallFailure`, not raised."""
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the driver
        return CallFailure(exc_type=type(exc).__name__,
                           traceback="".join(traceback.format_exception(exc)))


def check_outcome(value: Any, identity: WorkerIdentity, method: str) -> Any:
    """Return `value`, or raise the `WorkerError` it stands for if it is a `CallFailure`."""
    if isinstance(value, CallFailure):
        raise WorkerError(role=identity.role, rank=identity.rank, method=method,
                          reason="raised", detail=value.exc_type,
                          remote_traceback=value.traceback)
    return value


def free_port() -> int:
    """A TCP port that was free a moment ago on this machine (bind to port 0 and release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
