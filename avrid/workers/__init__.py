"""Chapter 1 — the worker layer: identity, mesh, placement, worker groups and two backends.

Read in this order: identity.py, mesh.py, placement.py (placement_figure.py draws a plan),
worker.py, group.py, cluster.py, outcome.py, inprocess.py, ray_backend.py, tensor_wire.py,
call_wire.py (errors.py as you meet them). The Ray backend is imported lazily (``RayBackend``,
``start_ray``) so the pure parts and the in-process backend work without importing Ray.
"""

from typing import TYPE_CHECKING, Any

from avrid.workers.cluster import Backend, Cluster, make_identity
from avrid.workers.errors import MeshError, PlacementError, UnknownMethodError, WorkerError
from avrid.workers.group import PendingCall, WorkerGroup
from avrid.workers.identity import Rendezvous, WorkerIdentity
from avrid.workers.inprocess import InProcessBackend
from avrid.workers.mesh import Mesh
from avrid.workers.placement import (
    Bundle,
    PlacementPlan,
    ResourcePool,
    RoleSpec,
    Slot,
    plan_placement,
)
from avrid.workers.worker import Worker

if TYPE_CHECKING:
    from avrid.workers.ray_backend import RayBackend, start_ray

__all__ = [
    "Backend", "Bundle", "Cluster", "InProcessBackend", "Mesh", "MeshError", "PendingCall",
    "PlacementError", "PlacementPlan", "RayBackend", "Rendezvous", "ResourcePool", "RoleSpec",
    "Slot", "UnknownMethodError", "Worker", "WorkerError", "WorkerGroup", "WorkerIdentity",
    "make_identity", "plan_placement", "start_ray",
]


def __getattr__(name: str) -> Any:
    # `import ray` costs ~0.3 s and is not needed for the pure parts: load it on first use.
    if name in ("RayBackend", "start_ray"):
        from avrid.workers import ray_backend

        return getattr(ray_backend, name)
    raise AttributeError(f"module 'avrid.workers' has no attribute {name!r}")
