"""Chapter 7 — which sandbox runs a tool call, and the one entry point: `run_python`.

An environment calls ``run_python(code, limits)`` and does not know where the code runs.
The run decides, once, from its config (``tools.sandbox``):

    namespaces   (default on Linux) the kernel's namespaces through bubblewrap
    remote       a SandboxFusion-compatible service at ``tools.remote_url``
    process      a child process with audit hooks: NOT a boundary; only when asked for
                 by name (the only local choice on macOS), with a warning

The choice reaches `run_python` through a context variable: the rollout worker wraps its
episode loop in ``with use_sandbox(sandbox):``, and the loop runs each environment step in a
copy of that context. Outside any `use_sandbox`, `run_python` uses the namespaces backend.
There is no fallback: a backend that cannot run raises `SandboxUnavailable`, naming why and
what to choose instead, and never hands the call to a weaker one.

Not here: the backends (`namespaces.py`, `remote.py`, `process.py`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import typing
from collections.abc import Iterator
from typing import Literal

from avrid.agents.sandbox.base import Sandbox, ToolLimits, ToolResult
from avrid.agents.sandbox.namespaces import NamespaceSandbox
from avrid.agents.sandbox.process import ProcessSandbox
from avrid.agents.sandbox.remote import RemoteSandbox

SandboxName = Literal["namespaces", "remote", "process"]
SANDBOXES: tuple[str, ...] = typing.get_args(SandboxName)

_current: contextvars.ContextVar[Sandbox | None] = contextvars.ContextVar(
    "avrid_sandbox", default=None)


def make_sandbox(name: str, *, url: str | None = None, concurrency: int = 64,
                 retries: int = 2) -> Sandbox:
    """The backend called `name`; `url`, `retries`: the remote one's; `concurrency`: calls in
    flight at once from this process. Nothing is started or checked here (`Sandbox.check`)."""
    if name == "namespaces":
        return NamespaceSandbox(max_concurrent=concurrency)
    if name == "process":
        return ProcessSandbox(max_concurrent=concurrency)
    if name == "remote":
        if not url:
            raise ValueError("tools.sandbox='remote' needs tools.remote_url (the service's "
                             "address, e.g. http://sandbox:8080)")
        return RemoteSandbox(url, concurrency=concurrency, retries=retries)
    raise ValueError(f"tools.sandbox must be one of {SANDBOXES}, got {name!r}")


@contextlib.contextmanager
def use_sandbox(sandbox: Sandbox) -> Iterator[Sandbox]:
    """Within the block (and in contexts copied from it), `run_python` uses `sandbox`."""
    token = _current.set(sandbox)
    try:
        yield sandbox
    finally:
        _current.reset(token)


@functools.cache
def _default() -> Sandbox:
    return NamespaceSandbox()


def current_sandbox() -> Sandbox:
    """The sandbox `run_python` uses here: the innermost `use_sandbox`'s, else namespaces."""
    return _current.get() or _default()


def run_python(code: str, limits: ToolLimits | None = None, *,
               sandbox: Sandbox | None = None) -> ToolResult:
    """Run `code` (Python source) in `sandbox` (default: `current_sandbox()`); always
    returns, within about `limits.wall_s`, with nothing of the call left running or left on
    disk. Raises only `SandboxUnavailable` (the backend cannot run here at all).

    Example: ``run_python("print(6 * 7)").observation()`` is ``"42\\n"``; a refusal, an
    error and a timeout are results too (``[tool timed out after 5.0 s]``).
    """
    return (sandbox or current_sandbox()).run(code, limits or ToolLimits())
