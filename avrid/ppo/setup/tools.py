"""Chapter 7 — the `tools` section of the config: where a multi-turn task's tool code runs.

A task whose environment runs the policy's code (`avrid.agents.gsm8k_tool`'s Python tool,
or a user's through `avrid.agents.sandbox.run_python`) runs it in the sandbox this section
picks, on every rollout worker:

    namespaces   (default) the kernel's namespaces through bubblewrap, on the worker's own
                 machine: no file, process or network of the host is reachable
    remote       a SandboxFusion-compatible service at `remote_url` (``POST /run_code``):
                 the code runs on the service's machines; the trainer checks it answers
                 before the first step
    process      a child process with audit hooks: NOT a security boundary (code that means
                 to can read your files and signal the trainer); for trusted code, or macOS

Nothing falls back: a backend that cannot run on a worker fails that worker's first tool
call with the reason and the alternatives. What each backend isolates is in the docstring
of `avrid/agents/sandbox/__init__.py`. A task that runs no code (the calculator of
`tiny-agent`) never starts a sandbox, so this section does not matter to it.

A resumed run may change this section: it says where tools run, not what they compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from avrid.ppo.setup.validate import need, one_of

SandboxChoice = Literal["namespaces", "remote", "process"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolsConfig:
    """Where a multi-turn task's tool code runs (chapter 7): the sandbox and its settings."""

    sandbox: SandboxChoice = "namespaces"
    """"namespaces" (bubblewrap, the default), "remote" (a SandboxFusion-compatible service
    at remote_url) or "process" (audit hooks: not a boundary, only when asked for)."""
    remote_url: str | None = None
    """The service of sandbox="remote", e.g. "http://sandbox:8080" (its ``/run_code``)."""
    concurrency: int = 64
    """Tool calls one rollout worker runs at once, at most (each holds a few descriptors,
    a thread and its processes; with remote, requests in flight)."""
    remote_retries: int = 2
    """sandbox="remote": tries after a refused or reset connection or a 502/503/504."""

    def __post_init__(self) -> None:
        one_of("tools.sandbox", self.sandbox, SandboxChoice, "sandbox")
        need(self.sandbox != "remote" or bool(self.remote_url), "tools.remote_url",
             "tools.sandbox='remote' needs the service's address, e.g. http://sandbox:8080")
        need(self.remote_url is None or self.remote_url.startswith(("http://", "https://")),
             "tools.remote_url", f"must start with http:// or https://, got {self.remote_url!r}")
        need(self.concurrency >= 1, "tools.concurrency", f"must be >= 1, got {self.concurrency}")
        need(self.remote_retries >= 0, "tools.remote_retries",
             f"must be >= 0, got {self.remote_retries}")
