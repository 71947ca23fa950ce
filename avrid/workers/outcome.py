"""Chapter 1 — outcomes of a call: a method's value, or its failure carried as a value.

The in-process backend runs a worker's method (or constructor) through `capture`, which turns
any exception into a `CallFailure` holding the formatted traceback, so that a failure on one
rank can be reported the same way whichever backend ran it: one `WorkerError` naming role, rank,
method and the remote traceback (`check_outcome`). The Ray backend gets the same
information from Ray's own error types and builds the same `WorkerError` (`ray_backend.py`).

Also `root_cause` (which of several ranks' failures to report) and `free_port`, used to pick a
rendezvous port (below the ephemeral range: see there).
Nothing here imports Ray or torch.
"""

from __future__ import annotations

import random
import socket
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
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


def root_cause(failures: Sequence[WorkerError]) -> WorkerError:
    """The failure to report when several ranks failed together (the Ray backend sees them
    all): a death before an exception (peers of a dead rank fail *because* of it), then the
    lowest rank; the others are listed in a note."""
    first = min(failures, key=lambda f: (f.reason != "died", f.rank))
    others = [f"{f.role}[{f.rank}] {f.reason}" for f in failures if f is not first]
    if others:
        first.add_note("other ranks that failed with it: " + ", ".join(others))
    return first


def free_port() -> int:
    """A TCP port that was free a moment ago on this machine, picked at random BELOW the
    kernel's ephemeral range (`ephemeral_ports`; Linux's default is 32768-60999).

    Why below: the port is bound later — by rank 0's TCP store, seconds after it is picked,
    once its model is built — and until then a port from the ephemeral range can be handed
    by the kernel to any outgoing connection (Ray's and gloo's make many), which then fails
    the store with EADDRINUSE. A port below the range is only ever taken by an explicit bind.
    Falls back to any free port (bind to port 0) where that range is too small."""
    low, _ = ephemeral_ports()
    rng = random.SystemRandom()
    if low - _LOWEST_PICK >= 1000:
        for _ in range(50):
            port = rng.randrange(_LOWEST_PICK, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("", port))
                except OSError:
                    continue  # taken: try another
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections: Linux's
    /proc/sys/net/ipv4/ip_local_port_range, else IANA's 49152-65535 (macOS, Windows)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


_LOWEST_PICK = 20000
"""The lowest port `free_port` picks: above the well-known and most registered services."""
