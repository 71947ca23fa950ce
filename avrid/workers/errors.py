"""Chapter 1 — the errors the worker layer raises, each carrying what a person needs to act.

verl's worst failure mode is a silent hang or an error far from its cause. Here every failure of
a remote call becomes one `WorkerError` that names the role, the rank, the method and carries the
remote traceback; placement and mesh mistakes fail before anything starts. This file only
defines the types; the code that raises them lives next to the check it makes.
"""

from __future__ import annotations


class MeshError(ValueError):
    """A mesh is malformed or does not fit the group it is used for (e.g. 2x2 for 3 workers)."""


class PlacementError(RuntimeError):
    """A placement cannot be satisfied: it asks for more CPUs/GPUs than exist, or a bundle
    cannot hold the roles colocated on it. The message says what was asked and what exists."""


class UnknownMethodError(AttributeError):
    """A group call named something that is not a method of the group's worker class."""


class WorkerError(RuntimeError):
    """A remote call failed on one worker: it raised, it died, or it did not answer in time.

    Attributes:
        role: the worker's role, e.g. "actor".
        rank: the worker's rank in its group.
        method: the method that was called, e.g. "compute_log_probs".
        remote_traceback: the traceback text from the worker's process ("" when it died
            without one, e.g. killed by the OOM killer).
        reason: "raised", "died" or "timeout".
        headline: one line for a person: who failed, how, and the remote exception's
            message (what the `avrid` command prints).
    """

    def __init__(
        self, *, role: str, rank: int, method: str, reason: str, remote_traceback: str,
        detail: str = "",
    ) -> None:
        self.role = role
        self.rank = rank
        self.method = method
        self.reason = reason
        self.remote_traceback = remote_traceback
        head = f"{role}[{rank}].{method}() {reason}"
        if detail:
            head += f": {detail}"
        body = f"\n--- remote traceback of {role}[{rank}] ---\n{remote_traceback}" if (
            remote_traceback) else ""
        # The remote exception's own last line ("ValueError: reward nan ..."): what a person
        # reads first, so the command line can report the failure in one line.
        last = next((ln.strip() for ln in reversed(remote_traceback.splitlines())
                     if ln.strip()), "")
        self.headline = f"{role}[{rank}].{method}() {reason}: {last}" if last else head
        super().__init__(head + body)
