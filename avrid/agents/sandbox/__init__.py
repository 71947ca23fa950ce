"""Chapter 7 — tools in a sandbox: the policy's code run where it cannot reach anything else.

What each backend isolates, first (``tools.sandbox`` picks one; `choose.py`):

    namespaces  (default, Linux) The kernel's boundary. The code sees a read-only Python
                runtime and nothing else of the host: no home, no project, no data (the
                task's answer key included), no other process (its own PID namespace and
                /proc), no network but an empty loopback; it writes only a private tmpfs;
                every process it starts dies with the call; seccomp refuses ptrace, mount,
                keyctl, bpf and the like. Not isolated: the kernel itself, the CPU and memory
                bandwidth it shares, and anything you put in the runtime's directories.
    remote      Whatever the service isolates (SandboxFusion: a sandbox per call on its own
                machines). Nothing runs on the rollout's machine.
    process     NOT a boundary. A child process with audit hooks that refuse the obvious
                (writes outside its directory, sockets, subprocesses); code that means to can
                switch them off, read every file the user can, and signal or re-limit the
                trainer. For trusted code, or macOS.

Read in this order:

1. base.py        what a call may use (`ToolLimits`), how it ended (`ToolResult`), the
                  `Sandbox` protocol
2. boot.py        the program in front of the tool's code: rlimits, exit codes -> statuses
3. child.py       one child process: fed, read (capped), ended by its deadline
4. namespaces.py  the default backend: bubblewrap's namespaces
5. seccomp.py     the system calls a tool never needs, refused
6. remote.py      a SandboxFusion-compatible service over HTTP
7. process.py     the audit-hook backend, and why it is no boundary
8. cleanup.py     removing a directory a tool left, without raising
9. choose.py      picking a backend; `run_python`, the entry point

Every backend returns a `ToolResult` within about the call's wall time whatever the code
did; its status comes from how the child ended (`boot.py`), never from what it printed.
"""

from avrid.agents.sandbox.base import (
    Sandbox,
    SandboxUnavailable,
    ToolLimits,
    ToolResult,
    ToolStatus,
)
from avrid.agents.sandbox.choose import (
    SANDBOXES,
    SandboxName,
    current_sandbox,
    make_sandbox,
    run_python,
    use_sandbox,
)

__all__ = ["SANDBOXES", "Sandbox", "SandboxName", "SandboxUnavailable", "ToolLimits",
           "ToolResult", "ToolStatus", "current_sandbox", "make_sandbox", "run_python",
           "use_sandbox"]
