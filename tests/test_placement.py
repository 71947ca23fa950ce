"""Placement planning (pure): slots, colocation, and errors raised before anything starts."""

from __future__ import annotations

import pytest

from avrid.workers import (
    Bundle,
    Mesh,
    PlacementError,
    ResourcePool,
    RoleSpec,
    WorkerIdentity,
    plan_placement,
)
from tests.helpers import EchoWorker

pytestmark = pytest.mark.chapter(1)


def role(name: str, pool: str, n: int, **kw: object) -> RoleSpec:
    return RoleSpec(role=name, worker=EchoWorker, mesh=Mesh.of(dp=n), pool=pool, **kw)


def test_colocated_roles_share_bundles_and_separate_pools_do_not() -> None:
    gpus = ResourcePool.uniform("gpus", 4, cpus=3, gpus=1)
    other = ResourcePool.uniform("critic", 2, cpus=1, gpus=1)
    plan = plan_placement([gpus, other], [
        role("actor", "gpus", 4, cpus=1, gpus=1 / 3),
        role("rollout", "gpus", 4, cpus=1, gpus=1 / 3),
        role("ref", "gpus", 4, cpus=1, gpus=1 / 3),   # 3 x 1/3 of a GPU must fit in 1
        role("critic", "critic", 2, cpus=1, gpus=1),
    ])
    assert [s.bundle for s in plan.slots_of("actor")] == [0, 1, 2, 3]
    assert plan.colocated("actor", "rollout") and plan.colocated("actor", "ref")
    assert not plan.colocated("actor", "critic")
    text = plan.describe()
    assert "bundle 0 {'CPU': 3, 'GPU': 1}: actor[0]" in text and "critic[1]" in text


def test_several_workers_per_bundle_get_local_ranks() -> None:
    pool = ResourcePool(name="node", bundles=(Bundle(cpus=8, gpus=8),))
    plan = plan_placement([pool], [role("actor", "node", 8, gpus=1, workers_per_bundle=8)])
    assert {s.bundle for s in plan.slots_of("actor")} == {0}
    assert [s.local_rank for s in plan.slots_of("actor")] == list(range(8))


def test_overloaded_bundle_names_who_asks_for_what() -> None:
    pool = ResourcePool.uniform("gpus", 2, cpus=2, gpus=1)
    with pytest.raises(PlacementError) as err:
        plan_placement([pool], [role("actor", "gpus", 2, gpus=0.6),
                                role("rollout", "gpus", 2, gpus=0.6)])
    msg = str(err.value)
    assert "bundle 0 of pool 'gpus' holds 2 CPU and 1 GPU" in msg
    assert "actor[0] (1 CPU, 0.6 GPU), rollout[0] (1 CPU, 0.6 GPU)" in msg
    assert "2 CPU and 1.2 GPU" in msg


@pytest.mark.parametrize(("pools", "roles", "match"), [
    ([ResourcePool.uniform("p", 2)], [role("a", "p", 3)], "has 3 workers but pool 'p'"),
    ([ResourcePool.uniform("p", 2)], [role("a", "q", 1)], "asks for pool 'q'"),
    ([ResourcePool.uniform("p", 1)] * 2, [], "pool names must be unique"),
    ([ResourcePool.uniform("p", 2)], [role("a", "p", 1), role("a", "p", 1)],
     "role names must be unique"),
    ([ResourcePool.uniform("p", 2, gpus=2)], [role("a", "p", 1, gpus=1.5)],
     "must be a fraction <= 1 or a whole number"),
    ([ResourcePool.uniform("p", 2)], [role("a", "p", 1, cpus=-1)], "must be >= 0"),
])
def test_bad_plans_fail_before_anything_starts(pools, roles, match) -> None:  # noqa: ANN001
    with pytest.raises(PlacementError, match=match):
        plan_placement(pools, roles)


def test_bad_pools_and_bundles() -> None:
    with pytest.raises(PlacementError, match="not both 0"):
        Bundle(cpus=0, gpus=0)
    with pytest.raises(PlacementError, match="unknown strategy 'TIGHT'"):
        ResourcePool.uniform("p", 1, strategy="TIGHT")  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="no bundles"):
        ResourcePool(name="p", bundles=())


def test_identity_derives_the_torch_env() -> None:
    from avrid.workers import Rendezvous

    ident = WorkerIdentity(role="actor", rank=2, world_size=4, local_rank=1,
                           rendezvous=Rendezvous(master_addr="10.0.0.1", master_port=1234))
    assert ident.torch_env() == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                 "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    with pytest.raises(ValueError, match="rendezvous is not set"):
        WorkerIdentity(role="a", rank=0, world_size=1).torch_env()
    with pytest.raises(AttributeError):
        ident.rank = 3  # type: ignore[misc]  # frozen
