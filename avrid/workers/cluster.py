"""Chapter 1 — `Cluster`: the launched placement, its groups by role, and one exit for all.

`Backend.launch(plan)` returns a `Cluster`. It owns every worker group it started and the
reservations behind them (Ray placement groups), and releases all of it on `close()` — which
the context manager calls on exit, also after an error, so a failed test or a crashed demo
leaves no actors or placement groups behind.

Also here: `Backend`, the protocol both backends implement, and `make_identity`, the one place
where a rank's identity is derived from its role and slot (so both backends agree).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Protocol, TypeVar, overload

from avrid.workers.group import WorkerGroup
from avrid.workers.identity import Rendezvous, WorkerIdentity
from avrid.workers.placement import PlacementPlan, RoleSpec, Slot

W = TypeVar("W")


def make_identity(spec: RoleSpec, slot: Slot, rendezvous: Rendezvous | None) -> WorkerIdentity:
    """The identity of one rank, before it is placed (the backend fills in node and devices
    once the worker runs somewhere)."""
    return WorkerIdentity(role=spec.role, rank=slot.rank, world_size=spec.world_size,
                          coords=spec.mesh.coords(slot.rank), pool=slot.pool,
                          bundle=slot.bundle, local_rank=slot.local_rank,
                          rendezvous=rendezvous)


class Cluster:
    """The worker groups of a launched placement. Use it as a context manager.

    Example (a sketch; `chapters/ch01_workers` runs it for real)::

        with RayBackend().launch(plan) as cluster:
            actor = cluster.group("actor", ActorWorker)
            actor.call(ActorWorker.ping)
    """

    def __init__(self, plan: PlacementPlan, groups: Mapping[str, WorkerGroup],
                 release: Callable[[], None]) -> None:
        self.plan = plan
        self._groups = dict(groups)
        self._release = release
        self._closed = False

    @overload
    def group(self, role: str) -> WorkerGroup: ...
    @overload
    def group(self, role: str, worker_cls: type[W]) -> WorkerGroup[W]: ...

    def group(self, role: str, worker_cls: type | None = None) -> WorkerGroup:
        """The group of `role`. Passing the worker class gives a typed group and checks it."""
        if role not in self._groups:
            raise KeyError(f"no role {role!r} in this cluster; roles: {sorted(self._groups)}")
        group = self._groups[role]
        if worker_cls is not None and group.worker_cls is not worker_cls:
            raise TypeError(f"role {role!r} runs {group.worker_cls.__name__}, "
                            f"not {worker_cls.__name__}")
        return group

    @property
    def roles(self) -> list[str]:
        """Role names in launch order."""
        return list(self._groups)

    def close(self) -> None:
        """Stop every worker and release every reservation. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            for group in self._groups.values():
                group.close()
        finally:
            self._release()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class Backend(Protocol):
    """Starts the workers of a placement plan. `RayBackend` and `InProcessBackend` implement it
    with one contract: same groups, same calls, same results, same errors."""

    def launch(self, plan: PlacementPlan) -> Cluster:
        """Start one worker per slot of `plan` and return the cluster that owns them."""
        ...
