"""Dispatch through worker groups by DP coordinate: any batch size over any DP size comes back
in the original order, on Ray and in-process; TP replicas of a shard share one stored copy."""

from __future__ import annotations

import pytest
import torch

from avrid.dispatch import DispatchConfig, dispatch, make_plan
from avrid.workers import Backend, Mesh, ResourcePool, RoleSpec, plan_placement
from tests.helpers import ShardWorker
from tests.test_batch import make_batch

pytestmark = pytest.mark.chapter(2)


def launch(backend: Backend, mesh: Mesh):  # noqa: ANN201
    plan = plan_placement([ResourcePool.uniform("cpu", mesh.size, cpus=0.5)],
                          [RoleSpec(role="actor", worker=ShardWorker, mesh=mesh, pool="cpu",
                                    cpus=0.5)])
    return backend.launch(plan)


@pytest.mark.parametrize(("n", "mesh"), [(10, Mesh.of(dp=4)), (3, Mesh.of(dp=8)),
                                         (17, Mesh.of(dp=2, tp=2))])
def test_any_batch_over_any_dp_size_comes_back_in_order(backend: Backend, n: int,
                                                         mesh: Mesh) -> None:
    batch = make_batch([(1 + (7 * i) % 13, (5 * i) % 29) for i in range(n)], first_id=500)
    dp = mesh.axis_size("dp")
    plan = make_plan(batch, dp, DispatchConfig(micro_batch_tokens=24, same_micro_count=True))
    with launch(backend, mesh) as cluster:
        group = cluster.group("actor", ShardWorker)
        outs = dispatch(group, ShardWorker.score, plan, batch, bonus=1000)
    assert len(outs) == dp  # one answer per shard, from its collect (tp=0) rank
    merged = plan.restore(outs)
    assert merged.sample_ids.tolist() == batch.sample_ids.tolist()
    dp_of = torch.tensor([plan.locate(i)[0] for i in batch.sample_ids.tolist()])
    expected = (batch.total_lens * 10 + dp_of + 1000).to(torch.float32)
    assert torch.equal(merged.scalars["score"], expected)


def test_each_shard_is_stored_once_and_shared_by_its_tp_replicas(ray_cluster: None) -> None:
    from avrid.workers import RayBackend

    batch = make_batch([(2, 3)] * 8)
    plan = make_plan(batch, 2)
    with launch(RayBackend(), Mesh.of(dp=2, tp=2)) as cluster:
        group = cluster.group("actor", ShardWorker)
        puts: list[object] = []
        real_put = group.put
        group.put = lambda v: puts.append(v) or real_put(v)  # type: ignore[method-assign]
        sent: list[list[object]] = []
        real_call = group.submit_per_rank

        def spy(method, *args, **kwargs):  # noqa: ANN001, ANN202
            sent.append(list(args[0]))
            return real_call(method, *args, **kwargs)

        group.submit_per_rank = spy  # type: ignore[method-assign]
        dispatch(group, ShardWorker.score, plan, batch)
    assert len(puts) == 2  # one object-store copy per DP shard, not one per rank
    refs = sent[0]
    assert refs[0] is refs[1] and refs[2] is refs[3] and refs[0] is not refs[2]


def test_a_plan_for_another_dp_size_is_refused(backend: Backend) -> None:
    batch = make_batch([(1, 1)] * 4)
    with launch(backend, Mesh.of(dp=2)) as cluster:
        with pytest.raises(ValueError, match=r"the plan has 3 shards but actor's mesh \(dp=2\) "
                                             r"has 2 ranks along 'dp'"):
            dispatch(cluster.group("actor", ShardWorker), ShardWorker.score,
                     make_plan(batch, 3), batch)
