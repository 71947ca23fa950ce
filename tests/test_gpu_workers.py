"""GPU tier for chapter 1 (skips cleanly without CUDA): fractional colocation on a real GPU,
and an NCCL all-reduce across GPUs through the same rendezvous as the gloo tests."""

from __future__ import annotations

import pytest

from avrid.workers import Mesh, ResourcePool, RoleSpec, plan_placement
from tests.helpers import CudaWorker

pytestmark = [pytest.mark.chapter(1), pytest.mark.usefixtures("ray_cluster")]


@pytest.mark.gpu(count=1, duration_s=30, memory_gb=2)
def test_colocated_roles_share_one_real_gpu() -> None:
    from avrid.workers import RayBackend

    plan = plan_placement([ResourcePool.uniform("gpu", 1, cpus=2, gpus=1)], [
        RoleSpec(role="actor", worker=CudaWorker, mesh=Mesh.of(dp=1), pool="gpu", gpus=0.5),
        RoleSpec(role="rollout", worker=CudaWorker, mesh=Mesh.of(dp=1), pool="gpu", gpus=0.4),
    ])
    with RayBackend().launch(plan) as cluster:
        actor = cluster.group("actor", CudaWorker).call(CudaWorker.cuda_device)[0]
        rollout = cluster.group("rollout", CudaWorker).call(CudaWorker.cuda_device)[0]
    assert actor["uuid"] == rollout["uuid"]  # the very same physical GPU
    assert actor["devices"] == rollout["devices"] and len(actor["devices"]) == 1
    assert actor["sum"] == rollout["sum"] == 4.0


@pytest.mark.gpu(count=2, duration_s=30, memory_gb=2)
def test_nccl_all_reduce_across_gpus() -> None:
    import torch

    from avrid.workers import RayBackend

    n = torch.cuda.device_count()
    plan = plan_placement([ResourcePool.uniform("gpus", n, cpus=1, gpus=1)], [
        RoleSpec(role="actor", worker=CudaWorker, mesh=Mesh.of(dp=n), pool="gpus", gpus=1)])
    with RayBackend().launch(plan) as cluster:
        out = cluster.group("actor", CudaWorker).call(CudaWorker.nccl_all_reduce)
    assert out == [float(n * (n + 1) // 2)] * n
