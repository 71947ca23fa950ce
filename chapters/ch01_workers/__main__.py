"""Chapter 1 demo — place three roles, launch them on Ray and in-process, compare the results.

Run it with ``python -m chapters.ch01_workers`` (CPU only, well under a minute). It reads top
to bottom:

1. plan: "actor" and "rollout" are *colocated* on the four bundles of one pool, each taking
   half of every bundle (verl's hybrid engine); "critic" sits in a *separate* pool
   (disaggregated). `plan_placement` checks every bundle's load before anything starts.
2. Ray: start a local Ray with *pretend* GPUs so the 0.5 GPU shares are visible, launch the
   plan, print every worker's identity and show that colocated ranks share a bundle.
3. all-reduce: the 4 actor workers sum ``rank + 1`` with gloo; every rank must get 10.
4. in-process: the same plan on ``InProcessBackend(concurrent=True)`` (threads, no Ray) gives
   the same placement and the same sums.

The demo uses only `avrid.workers` and the example workers in ``workers.py``; it defines no
library code.
"""

from __future__ import annotations

import time

from avrid.workers import (
    Backend,
    Bundle,
    Cluster,
    InProcessBackend,
    Mesh,
    PlacementPlan,
    ResourcePool,
    RoleSpec,
    WorkerIdentity,
    plan_placement,
)
from chapters.ch01_workers.workers import EchoWorker, RolloutWorker, TrainerWorker

# Pretend GPUs: 4 in the shared pool + 2 in the critic's pool. Ray only counts them.
PRETEND_GPUS = 6


def build_plan() -> PlacementPlan:
    """Two colocated roles on one pool, a third role on its own pool."""
    shared = ResourcePool(name="shared", bundles=(Bundle(cpus=1, gpus=1),) * 4,
                          strategy="PACK")
    critic_pool = ResourcePool(name="critic", bundles=(Bundle(cpus=1, gpus=1),) * 2)
    roles = [
        # Same pool, same world size: rank r of both roles lands in bundle r, and each
        # takes half of its CPU and half of its GPU, so the two fit side by side.
        RoleSpec(role="actor", worker=TrainerWorker, mesh=Mesh.of(dp=4), pool="shared",
                 cpus=0.5, gpus=0.5),
        RoleSpec(role="rollout", worker=RolloutWorker, mesh=Mesh.of(dp=2, tp=2),
                 pool="shared", cpus=0.5, gpus=0.5),
        # Its own pool: it never competes with the actor or the rollout for a bundle.
        RoleSpec(role="critic", worker=TrainerWorker, mesh=Mesh.of(dp=2), pool="critic",
                 cpus=1, gpus=1),
    ]
    return plan_placement([shared, critic_pool], roles)


def identities(cluster: Cluster) -> list[WorkerIdentity]:
    """Every worker's identity, in role then rank order, as the driver recorded it."""
    return [ident for role in cluster.roles for ident in cluster.group(role).identities]


def show_identities(cluster: Cluster) -> None:
    """Ask each worker who it is: the answer comes from the identity handed to it."""
    for role in cluster.roles:
        group = cluster.group(role)
        for line in group.call(EchoWorker.whoami):
            print("  " + line)


def show_colocation(cluster: Cluster) -> None:
    """Group the workers by (pool, bundle): colocated roles appear in the same bundle."""
    pids = {role: cluster.group(role).call(EchoWorker.pid) for role in cluster.roles}
    by_bundle: dict[tuple[str, int], list[str]] = {}
    for ident in identities(cluster):
        devices = ",".join(ident.devices) or "cpu"
        label = f"{ident.name} (pid {pids[ident.role][ident.rank]}, devices {devices})"
        by_bundle.setdefault((ident.pool, ident.bundle), []).append(label)
    for (pool, bundle), names in by_bundle.items():
        print(f"  {pool}/bundle {bundle}: " + ", ".join(names))
    print(f"  actor and rollout colocated: {cluster.plan.colocated('actor', 'rollout')}; "
          f"actor and critic colocated: {cluster.plan.colocated('actor', 'critic')}")


def run_all_reduce(cluster: Cluster, role: str = "actor") -> list[float]:
    """Every rank of `role` sums ``rank + 1`` with gloo; with 4 ranks each must get 10."""
    group = cluster.group(role)
    sums = group.call(EchoWorker.all_reduce_rank)
    n = group.world_size
    expected = n * (n + 1) / 2
    status = "ok" if all(v == expected for v in sums) else "WRONG"
    print(f"  {role}: sum of rank+1 over {n} ranks = {sums} "
          f"(expected {expected:g} on every rank: {status})")
    return sums


def placement_of(idents: list[WorkerIdentity]) -> list[tuple[object, ...]]:
    """The backend-independent part of identities (node and devices differ by backend)."""
    return [(i.role, i.rank, tuple(i.coords.items()), i.pool, i.bundle, i.local_rank)
            for i in idents]


def run_scenario(backend: Backend,
                 plan: PlacementPlan) -> tuple[list[tuple[object, ...]], list[float]]:
    """Launch `plan` on `backend`, show who runs where, run the all-reduce, release all."""
    t0 = time.perf_counter()
    with backend.launch(plan) as cluster:
        n = len(identities(cluster))
        print(f"launched {n} workers in {time.perf_counter() - t0:.1f} s")
        print("identities (each worker describes itself):")
        show_identities(cluster)
        print("who shares a bundle:")
        show_colocation(cluster)
        print("gloo all-reduce:")
        sums = run_all_reduce(cluster)
        return placement_of(identities(cluster)), sums


def main() -> int:
    """Plan, run on Ray, run in-process, compare. Returns the exit status."""
    start = time.perf_counter()
    print("== 1. placement plan (pure, nothing started yet) ==")
    plan = build_plan()
    print(plan.describe())

    # Ray is imported only now: the plan above needs none of it.
    import ray

    from avrid.workers import RayBackend, start_ray

    print(f"\n== 2. Ray backend ==\nNOTE: starting Ray with {PRETEND_GPUS} PRETEND GPUs. "
          "They are bookkeeping only: Ray counts the 0.5 shares, no GPU computes anything.")
    start_ray(num_gpus=PRETEND_GPUS)
    try:
        ray_result = run_scenario(RayBackend(call_timeout_s=120), plan)
    finally:
        ray.shutdown()  # stops the raylet and workers this script started, even on error

    print("\n== 3. in-process backend (one thread per rank in this process, no Ray) ==")
    local_result = run_scenario(InProcessBackend(concurrent=True, call_timeout_s=120), plan)

    same_place = ray_result[0] == local_result[0]
    same_sums = ray_result[1] == local_result[1]
    print("\n== 4. Ray vs in-process ==")
    print(f"  same roles, ranks, coords, pools and bundles: {same_place}")
    print(f"  same all-reduce results: {same_sums} {local_result[1]}")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0 if same_place and same_sums else 1


if __name__ == "__main__":
    raise SystemExit(main())
