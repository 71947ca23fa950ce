"""Chapter 1 — who a worker is: `WorkerIdentity` and the torch.distributed `Rendezvous`.

A worker learns its role, rank, mesh coordinates and placement from one frozen value that the
driver hands it, instead of reading a dozen scattered environment variables (verl's way). The
identity is the single source of truth; the environment variables torch.distributed expects
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) are *derived* from it.

This file is pure data: no Ray, no torch. It does not start processes or process groups; the
backends (`ray_backend.py`, `inprocess.py`) and `Worker.init_distributed` do that.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True, slots=True, kw_only=True)
class Rendezvous:
    """Where the ranks of one worker group meet to form a torch.distributed process group.

    Example:
        >>> Rendezvous(master_addr="10.0.0.5", master_port=29500, in_process=False)
        Rendezvous(master_addr='10.0.0.5', master_port=29500, in_process=False)
    """

    master_addr: str
    """IP of the node that hosts rank 0; the TCP store lives there."""
    master_port: int
    """A free TCP port on that node, picked by rank 0's process."""
    in_process: bool = False
    """True when all ranks are threads of one process (the in-process backend): they cannot
    share the process-global default group, so each builds its own gloo group object."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerIdentity:
    """Everything a worker needs to know about itself, decided by the driver.

    Example (rank 3 of an actor group on a dp=2 x tp=2 mesh, second bundle of its pool):
        >>> ident = WorkerIdentity(role="actor", rank=3, world_size=4,
        ...     coords={"dp": 1, "tp": 1}, pool="gpus", bundle=1, local_rank=1)
        >>> ident.name
        'actor[3]'
        >>> ident.coords["dp"]
        1
    """

    role: str
    """The role this worker plays: "actor", "critic", "rollout", ..."""
    rank: int
    """Global rank inside its role's group, 0 <= rank < world_size."""
    world_size: int
    """Number of workers in the role's group."""
    coords: Mapping[str, int] = field(default_factory=dict, hash=False)
    """Mesh coordinates of this rank, e.g. {"dp": 1, "tp": 0}; see `Mesh.coords`. Stored as a
    read-only mapping so the identity stays immutable (Ray's cloudpickle carries it)."""
    pool: str = ""
    """Name of the resource pool (placement group) the worker was placed in."""
    bundle: int = 0
    """Index of the bundle inside that pool; workers of colocated roles share bundles."""
    local_rank: int = 0
    """Index among this role's workers in the same bundle (0 when one worker per bundle)."""
    node: str = ""
    """Node IP the worker runs on; filled in by the worker process once it is placed."""
    node_id: str = ""
    """Ray's id of that node, filled in with `node`: it tells nodes apart even where several
    share one IP (containers, a test cluster on one machine). Empty in-process."""
    devices: tuple[str, ...] = ()
    """Accelerator ids the worker may use (e.g. ("0",)); empty on CPU."""
    rendezvous: Rendezvous | None = None
    """Where to meet the group's other ranks for torch.distributed; None before it is known."""

    def __post_init__(self) -> None:
        # A frozen dataclass still holds whatever mapping it was given; copy it read-only.
        object.__setattr__(self, "coords", MappingProxyType(dict(self.coords)))

    @property
    def name(self) -> str:
        """Short label for messages and logs, e.g. ``actor[3]``."""
        return f"{self.role}[{self.rank}]"

    def torch_env(self) -> dict[str, str]:
        """The environment variables `torch.distributed.init_process_group("env://")` reads.

        Raises:
            ValueError: if the rendezvous is not known yet.
        """
        if self.rendezvous is None:
            raise ValueError(f"{self.name}: rendezvous is not set, so there is no torch env yet")
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.rendezvous.master_addr,
            "MASTER_PORT": str(self.rendezvous.master_port),
        }

    def describe(self) -> str:
        """One line for demos: name, mesh coordinates, placement and devices."""
        coords = ",".join(f"{k}={v}" for k, v in self.coords.items()) or "-"
        devices = ",".join(self.devices) or "cpu"
        return (
            f"{self.name:<12} coords({coords}) pool={self.pool} bundle={self.bundle} "
            f"local_rank={self.local_rank} node={self.node or '?'} devices={devices}"
        )
