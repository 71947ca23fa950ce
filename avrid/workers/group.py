"""Chapter 1 — `WorkerGroup`: call a method on every rank of a role, explicitly.

A call names the worker class's real method and says how arguments spread:

    group.call(ActorWorker.step, lr)               # same arguments to every rank
    group.call_per_rank(ActorWorker.load, shards)  # argument i goes to rank i

Because the method is passed as the function object itself, an IDE jumps to it and a type
checker checks the arguments of `call` against its signature (ParamSpec). At run time the group
checks that the function really belongs to the worker class and sends only its name. Compare
verl, which binds generated methods onto the group by scanning `dir()` of the worker class.

The group is backend-agnostic: a `Channel` (Ray actors, or workers in this process) moves the
call and gathers the outcomes. This file does not place or start workers (the backends do) and
does not split data (chapter 2's dispatch does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

from avrid.workers.errors import UnknownMethodError
from avrid.workers.identity import WorkerIdentity
from avrid.workers.mesh import Mesh

W = TypeVar("W")
P = ParamSpec("P")
R = TypeVar("R")


class Channel(Protocol):
    """How a backend reaches the ranks of one group. Implemented by the Ray and in-process
    backends; the group never knows which one it talks to."""

    def submit(self, rank: int, method: str, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        """Start ``method(*args, **kwargs)`` on `rank`; return a ticket for `gather`."""
        ...

    def wait(self, tickets: Sequence[Any], ranks: Sequence[int], method: str,
             timeout_s: float | None) -> None:
        """Wait until every ticket has finished, without fetching the outcomes. Raises
        `WorkerError` as soon as one rank raised or died while others still run, or when
        `timeout_s` passes with ranks still running."""
        ...

    def gather(self, tickets: Sequence[Any], ranks: Sequence[int], method: str,
               timeout_s: float | None) -> list[Any]:
        """`wait`, then fetch the outcomes (Ray: copy and deserialise them) in order; raises
        `WorkerError` for the rank that failed (the root cause when several did)."""
        ...

    def done(self, tickets: Sequence[Any]) -> bool:
        """Whether every ticket has finished (well or not), without waiting."""
        ...

    def put(self, value: Any) -> Any:
        """Store `value` once where every rank can read it; return what to pass instead
        (a Ray ObjectRef, resolved before the method runs; in-process, the value itself)."""
        ...

    def close(self) -> None:
        """Release the workers (kill actors / stop threads)."""
        ...


@dataclass(frozen=True, slots=True)
class PendingCall(Generic[R]):
    """A call that has been sent to some ranks and not yet gathered."""

    channel: Channel
    tickets: tuple[Any, ...]
    ranks: tuple[int, ...]
    method: str

    def result(self, timeout_s: float | None = None) -> list[R]:
        """The outcomes in rank order; raises `WorkerError` for the first rank that failed."""
        return self.channel.gather(self.tickets, self.ranks, self.method, timeout_s)

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait until every rank has finished without fetching anything, so that a caller can
        time the wait and the fetch (`result`, then immediate) apart."""
        self.channel.wait(self.tickets, self.ranks, self.method, timeout_s)

    def done(self) -> bool:
        """Whether every rank has finished, so `result` would not wait (a driver keeping two
        groups busy asks this between its own steps)."""
        return self.channel.done(self.tickets)


class WorkerGroup(Generic[W]):
    """The workers of one role, one per rank, with explicit method calls.

    Example (a sketch, any backend; `chapters/ch01_workers` runs it for real)::

        with InProcessBackend().launch(plan) as cluster:
            actors = cluster.group("actor", ActorWorker)
            actors.call(ActorWorker.ping)                       # -> one result per rank
    """

    def __init__(self, *, role: str, worker_cls: type[W], mesh: Mesh,
                 identities: Sequence[WorkerIdentity], channel: Channel,
                 call_timeout_s: float | None = None) -> None:
        mesh.check_world_size(len(identities))
        self.role = role
        self.worker_cls = worker_cls
        self.mesh = mesh
        self.identities: tuple[WorkerIdentity, ...] = tuple(identities)
        self.call_timeout_s = call_timeout_s
        self._channel = channel

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return len(self.identities)

    def call(self, method: Callable[Concatenate[W, P], R], *args: P.args,
             **kwargs: P.kwargs) -> list[R]:
        """Run `method` on every rank with the same arguments; results in rank order."""
        return self.submit(method, *args, **kwargs).result(self.call_timeout_s)

    def submit(self, method: Callable[Concatenate[W, P], R], *args: P.args,
               **kwargs: P.kwargs) -> PendingCall[R]:
        """Like `call`, but return at once; `.result()` waits. Lets two groups run at once."""
        ranks = range(self.world_size)
        return self._send(method, [(r, args, kwargs) for r in ranks])

    def call_per_rank(self, method: Callable[..., R], *args: Sequence[Any],
                      **kwargs: Sequence[Any]) -> list[R]:
        """Run `method` on every rank; each argument is a sequence whose item i goes to rank i."""
        return self.submit_per_rank(method, *args, **kwargs).result(self.call_timeout_s)

    def submit_per_rank(self, method: Callable[..., R], *args: Sequence[Any],
                        **kwargs: Sequence[Any]) -> PendingCall[R]:
        """Like `call_per_rank`, but return at once."""
        name = self._method_name(method)
        for label, seq in [*((f"argument {i}", a) for i, a in enumerate(args)),
                           *((f"keyword {k!r}", v) for k, v in kwargs.items())]:
            if len(seq) != self.world_size:
                raise ValueError(f"{self.role}.{name}: per-rank {label} has {len(seq)} items, "
                                 f"the group has {self.world_size} ranks")
        calls = [(r, tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()})
                 for r in range(self.world_size)]
        return self._send(method, calls)

    def call_ranks(self, ranks: Sequence[int], method: Callable[Concatenate[W, P], R],
                   *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run `method` on the given ranks only (same arguments); results in that order."""
        for r in ranks:
            if not 0 <= r < self.world_size:
                raise ValueError(f"{self.role}: rank {r} outside 0..{self.world_size - 1}")
        return self._send(method, [(r, args, kwargs) for r in ranks]).result(self.call_timeout_s)

    def put(self, value: Any) -> Any:
        """Store `value` once for many calls: pass the returned handle as an argument (to
        several ranks, e.g. the TP replicas of one DP shard) instead of the value itself, so
        it is serialised once, not once per rank."""
        return self._channel.put(value)

    def _send(self, method: Callable[..., Any],
              calls: Sequence[tuple[int, tuple[Any, ...], dict[str, Any]]]) -> PendingCall[Any]:
        name = self._method_name(method)
        tickets = tuple(self._channel.submit(r, name, a, k) for r, a, k in calls)
        return PendingCall(self._channel, tickets, tuple(r for r, _, _ in calls), name)

    def _method_name(self, method: Callable[..., Any]) -> str:
        # The function object must be the one the worker class resolves its name to, so that
        # a method of another class (or a lambda) fails here, before anything is sent.
        name = getattr(method, "__name__", None)
        cls_name = self.worker_cls.__name__
        if not isinstance(name, str) or getattr(self.worker_cls, name, None) is not method:
            raise UnknownMethodError(
                f"{method!r} is not a method of {cls_name} (the worker class of role "
                f"{self.role!r}); pass it as {cls_name}.<method>, e.g. {cls_name}.ping"
            )
        if name.startswith("_"):
            raise UnknownMethodError(f"{cls_name}.{name} is private; group calls take public "
                                     f"methods only")
        return name

    def close(self) -> None:
        """Release this group's workers. Usually done by the enclosing `Cluster`."""
        self._channel.close()

    def __repr__(self) -> str:
        return (f"WorkerGroup(role={self.role!r}, worker={self.worker_cls.__name__}, "
                f"mesh={self.mesh}, world_size={self.world_size})")
