"""Chapter 1 — `WorkerHost`: the thin shell that every backend runs around a user's `Worker`.

On Ray the host is the actor; in-process it is a plain object. Either way it (1) reports where
it landed (node, devices, a free port for the rendezvous), (2) builds the user's worker from its
identity, and (3) runs a named method, turning any exception into a `CallFailure` value that
carries the formatted traceback. Returning failures as values (not raising) lets both backends
report errors identically: one `WorkerError` with role, rank, method and the remote traceback.

The host does not choose which methods exist: the group checks the name against the worker
class before sending. It does not import Ray; `ray_backend.py` subclasses it for node info.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from avrid.workers.errors import WorkerError
from avrid.workers.identity import WorkerIdentity


@dataclass(frozen=True, slots=True, kw_only=True)
class CallFailure:
    """What a host returns instead of raising: the exception's type and formatted traceback."""

    exc_type: str
    traceback: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Location:
    """Where a host landed: node IP, visible accelerator ids, and a free port on that node."""

    node: str
    devices: tuple[str, ...]
    free_port: int


def free_port() -> int:
    """A TCP port that was free a moment ago on this machine (bind to port 0 and release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class WorkerHost:
    """Runs one rank's worker. Construct empty, then `start`, then `call` any number of times."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.identity: WorkerIdentity | None = None

    def locate(self) -> Location:
        """Where this host runs. The in-process host is on the loopback and sees no devices."""
        return Location(node="127.0.0.1", devices=(), free_port=free_port())

    def start(self, identity: WorkerIdentity, worker_cls: type, init_kwargs: Mapping[str, Any],
              export_env: bool) -> WorkerIdentity | CallFailure:
        """Build the user's worker. `export_env` sets RANK/WORLD_SIZE/... (one process per rank
        only: threads would overwrite each other's). Returns the identity completed with the
        node and devices, or the failure of the worker's constructor."""
        where = self.locate()
        self.identity = replace(identity, node=where.node, devices=where.devices)
        if export_env and self.identity.rendezvous is not None:
            os.environ.update(self.identity.torch_env())
        try:
            self.worker = worker_cls(self.identity, **init_kwargs)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the driver
            return _failure(exc)
        return self.identity

    def call(self, method_name: str, /, *args: Any, **kwargs: Any) -> Any:
        """Run ``worker.method_name(*args, **kwargs)``; an exception comes back as a value."""
        try:
            return getattr(self.worker, method_name)(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the driver
            return _failure(exc)


def _failure(exc: BaseException) -> CallFailure:
    text = "".join(traceback.format_exception(exc))
    return CallFailure(exc_type=type(exc).__name__, traceback=text)


def failure_of(value: Any, identity: WorkerIdentity, method: str) -> WorkerError | None:
    """The `WorkerError` that `value` stands for if it is a `CallFailure`, else None."""
    if not isinstance(value, CallFailure):
        return None
    return WorkerError(role=identity.role, rank=identity.rank, method=method, reason="raised",
                       detail=value.exc_type, remote_traceback=value.traceback)


def check_outcome(value: Any, identity: WorkerIdentity, method: str) -> Any:
    """Return `value`, or raise the `WorkerError` it stands for if it is a `CallFailure`."""
    error = failure_of(value, identity, method)
    if error is not None:
        raise error
    return value
