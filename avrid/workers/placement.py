"""Chapter 1 — placement: which worker of which role runs in which bundle of which pool.

A *resource pool* is a list of bundles ({CPU, GPU} each) that Ray reserves atomically as one
placement group; a *role* (actor, rollout, critic, ...) puts one worker per rank into a pool's
bundles. Two roles in the same pool share its bundles — they are *colocated* (verl's hybrid
engine), each taking a fractional share of the bundle's GPU. Roles in different pools are
*disaggregated*. CPU-only bundles make every layout runnable on a laptop.

`plan_placement` is pure: it assigns every (role, rank) a slot and checks, before anything is
started, that each bundle can hold the shares put on it. Creating the placement groups and the
actors is the Ray backend's job (`ray_backend.py`), which also checks the plan against the
cluster's real resources.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from avrid.workers.errors import PlacementError
from avrid.workers.mesh import Mesh

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
"""How a pool's bundles are laid over nodes (Ray's placement-group strategies)."""
STRATEGIES: tuple[str, ...] = get_args(Strategy)
_EPS = 1e-9  # fractional shares such as 3 x 1/3 must still fit in 1 GPU


@dataclass(frozen=True, slots=True, kw_only=True)
class Bundle:
    """Resources reserved together on one node, e.g. ``Bundle(cpus=4, gpus=1)``."""

    cpus: float = 1.0
    """Logical CPUs in the bundle."""
    gpus: float = 0.0
    """GPUs in the bundle (0 for a CPU-only bundle)."""

    def __post_init__(self) -> None:
        if self.cpus < 0 or self.gpus < 0 or (self.cpus == 0 and self.gpus == 0):
            raise PlacementError(
                f"a bundle needs cpus >= 0 and gpus >= 0, not both 0; got cpus={self.cpus}, "
                f"gpus={self.gpus}"
            )

    def as_ray(self) -> dict[str, float]:
        """The dict Ray's `placement_group` expects (zero entries dropped)."""
        return {k: v for k, v in (("CPU", self.cpus), ("GPU", self.gpus)) if v > 0}


@dataclass(frozen=True, slots=True, kw_only=True)
class ResourcePool:
    """A named set of bundles reserved as one placement group.

    Example (4 GPUs on one node, each bundle also reserving 2 CPUs):
        >>> pool = ResourcePool(name="gpus", bundles=(Bundle(cpus=2, gpus=1),) * 4,
        ...                     strategy="STRICT_PACK")
        >>> pool.total()
        {'CPU': 8.0, 'GPU': 4.0}
    """

    name: str
    """Unique name; roles refer to their pool by it."""
    bundles: tuple[Bundle, ...]
    """The bundles; a role's rank r lands in bundle r // workers_per_bundle."""
    strategy: Strategy = "PACK"
    """PACK (few nodes), SPREAD (many nodes), STRICT_PACK (one node), STRICT_SPREAD (one
    node per bundle)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise PlacementError("a resource pool needs a non-empty name")
        if not self.bundles:
            raise PlacementError(f"pool {self.name!r} has no bundles; give it at least one")
        if self.strategy not in STRATEGIES:
            raise PlacementError(
                f"pool {self.name!r}: unknown strategy {self.strategy!r}; allowed: {STRATEGIES}"
            )

    @classmethod
    def uniform(cls, name: str, n: int, *, cpus: float = 1.0, gpus: float = 0.0,
                strategy: Strategy = "PACK") -> ResourcePool:
        """`n` identical bundles, e.g. ``ResourcePool.uniform("cpu", 4)`` for a laptop."""
        if n < 1:
            raise PlacementError(f"pool {name!r} needs at least 1 bundle, got {n}")
        return cls(name=name, bundles=(Bundle(cpus=cpus, gpus=gpus),) * n, strategy=strategy)

    def total(self) -> dict[str, float]:
        """Total CPUs and GPUs the pool reserves."""
        return {"CPU": float(sum(b.cpus for b in self.bundles)),
                "GPU": float(sum(b.gpus for b in self.bundles))}


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleSpec:
    """One role: its worker class, its mesh (hence world size), its pool and its per-worker share.

    Example (a colocated actor taking half of each GPU bundle):
        >>> spec = RoleSpec(role="actor", worker=object, mesh=Mesh.of(dp=4), pool="gpus",
        ...                 cpus=1, gpus=0.5)
        >>> spec.world_size
        4
    """

    role: str
    """Role name, unique in a placement ("actor", "rollout", ...)."""
    worker: type
    """The `Worker` subclass to instantiate, once per rank."""
    mesh: Mesh
    """How the role's ranks are arranged (dp, tp, ...); its size is the world size."""
    pool: str
    """Name of the pool whose bundles the workers go into."""
    cpus: float = 1.0
    """Logical CPUs each worker reserves inside its bundle."""
    gpus: float = 0.0
    """GPU share each worker reserves: a fraction (colocated roles) or a whole number."""
    workers_per_bundle: int = 1
    """How many of this role's ranks share one bundle (e.g. 8 ranks in one 8-GPU bundle)."""
    init_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to ``worker(identity, **init_kwargs)``."""

    @property
    def world_size(self) -> int:
        """Number of workers (ranks) of this role."""
        return self.mesh.size


@dataclass(frozen=True, slots=True, kw_only=True)
class Slot:
    """Where one rank of one role runs and what it reserves."""

    role: str
    rank: int
    pool: str
    bundle: int
    local_rank: int
    """Index among this role's workers in the same bundle."""
    cpus: float
    gpus: float


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementPlan:
    """The checked assignment of every (role, rank) to a bundle; build it with `plan_placement`."""

    pools: tuple[ResourcePool, ...]
    roles: tuple[RoleSpec, ...]
    slots: tuple[Slot, ...]

    def pool(self, name: str) -> ResourcePool:
        """The pool called `name`."""
        for p in self.pools:
            if p.name == name:
                return p
        raise PlacementError(f"no pool named {name!r}; pools: {[p.name for p in self.pools]}")

    def role(self, name: str) -> RoleSpec:
        """The role called `name`."""
        for r in self.roles:
            if r.role == name:
                return r
        raise PlacementError(f"no role named {name!r}; roles: {[r.role for r in self.roles]}")

    def slots_of(self, role: str) -> list[Slot]:
        """The slots of one role in rank order."""
        return [s for s in self.slots if s.role == role]

    def colocated(self, role_a: str, role_b: str) -> bool:
        """True if some bundle holds workers of both roles."""
        where_a = {(s.pool, s.bundle) for s in self.slots_of(role_a)}
        return any((s.pool, s.bundle) in where_a for s in self.slots_of(role_b))

    def describe(self) -> str:
        """A table: one line per bundle with the roles and shares placed on it."""
        lines = []
        for p in self.pools:
            n = len(p.bundles)
            lines.append(f"pool {p.name!r} ({p.strategy}, {n} bundle{'s' * (n != 1)})")
            for b, bundle in enumerate(p.bundles):
                held = [f"{s.role}[{s.rank}] ({s.cpus:g} CPU, {s.gpus:g} GPU)"
                        for s in self.slots if s.pool == p.name and s.bundle == b]
                lines.append(f"  bundle {b} {bundle.as_ray()}: " + (", ".join(held) or "empty"))
        return "\n".join(lines)


def plan_placement(pools: Sequence[ResourcePool], roles: Sequence[RoleSpec]) -> PlacementPlan:
    """Assign every rank of every role to a bundle and check that each bundle can hold its load.

    Rank r of a role goes to bundle ``r // workers_per_bundle`` of its pool, so colocated roles
    with the same world size put rank r of each role in the same bundle (same GPU).

    Raises:
        PlacementError: duplicate names, an unknown pool, a role with more ranks than its pool
            has room for, a GPU share Ray cannot express, or a bundle whose load exceeds it.
    """
    by_name = {p.name: p for p in pools}
    if len(by_name) != len(pools):
        raise PlacementError(f"pool names must be unique, got {[p.name for p in pools]}")
    if len({r.role for r in roles}) != len(roles):
        raise PlacementError(f"role names must be unique, got {[r.role for r in roles]}")
    slots: list[Slot] = []
    for spec in roles:
        pool = by_name.get(spec.pool)
        if pool is None:
            raise PlacementError(f"role {spec.role!r} asks for pool {spec.pool!r}; "
                                 f"pools: {sorted(by_name)}")
        _check_share(spec)
        room = len(pool.bundles) * spec.workers_per_bundle
        if spec.world_size > room:
            raise PlacementError(
                f"role {spec.role!r} has {spec.world_size} workers but pool {pool.name!r} has "
                f"{len(pool.bundles)} bundles x {spec.workers_per_bundle} workers per bundle "
                f"= room for {room}"
            )
        for rank in range(spec.world_size):
            slots.append(Slot(role=spec.role, rank=rank, pool=pool.name,
                              bundle=rank // spec.workers_per_bundle,
                              local_rank=rank % spec.workers_per_bundle,
                              cpus=spec.cpus, gpus=spec.gpus))
    _check_bundle_loads(pools, slots)
    return PlacementPlan(pools=tuple(pools), roles=tuple(roles), slots=tuple(slots))


def _check_share(spec: RoleSpec) -> None:
    if spec.cpus < 0 or spec.gpus < 0:
        raise PlacementError(f"role {spec.role!r}: cpus and gpus must be >= 0, "
                             f"got cpus={spec.cpus}, gpus={spec.gpus}")
    # Ray accepts a fractional GPU only below 1; above 1 it must be a whole number.
    if spec.gpus > 1 and spec.gpus != int(spec.gpus):
        raise PlacementError(f"role {spec.role!r}: gpus={spec.gpus} per worker must be a "
                             f"fraction <= 1 or a whole number")
    if spec.workers_per_bundle < 1:
        raise PlacementError(f"role {spec.role!r}: workers_per_bundle must be >= 1, "
                             f"got {spec.workers_per_bundle}")


def _check_bundle_loads(pools: Sequence[ResourcePool], slots: Sequence[Slot]) -> None:
    for pool in pools:
        for b, bundle in enumerate(pool.bundles):
            here = [s for s in slots if s.pool == pool.name and s.bundle == b]
            cpus = sum(s.cpus for s in here)
            gpus = sum(s.gpus for s in here)
            if cpus > bundle.cpus + _EPS or gpus > bundle.gpus + _EPS:
                who = ", ".join(f"{s.role}[{s.rank}] ({s.cpus:g} CPU, {s.gpus:g} GPU)"
                                for s in here)
                raise PlacementError(
                    f"bundle {b} of pool {pool.name!r} holds {bundle.cpus:g} CPU and "
                    f"{bundle.gpus:g} GPU, but {who} ask for {cpus:g} CPU and {gpus:g} GPU"
                )
