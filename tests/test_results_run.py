"""The full round trip on both backends: plan, send, canonical results, merge, with a dp x tp
group where only the tp = 0 ranks send data back."""

from __future__ import annotations

import pytest
import torch

from avrid.dispatch import DispatchConfig
from avrid.results import run_shards
from avrid.workers import Backend, Mesh, ResourcePool, RoleSpec, plan_placement
from tests.helpers import ResultWorker
from tests.test_batch import make_batch

pytestmark = pytest.mark.chapter(3)


@pytest.mark.parametrize("strategy", ["micro", "padded"])
def test_round_trip_in_a_dp_x_tp_group(backend: Backend, strategy: str) -> None:
    batch = make_batch([(1 + i % 4, (13 * i) % 37) for i in range(23)], first_id=300)
    mesh = Mesh.of(dp=2, tp=2)
    placement = plan_placement([ResourcePool.uniform("cpu", 4, cpus=0.5)],
                               [RoleSpec(role="actor", worker=ResultWorker, mesh=mesh,
                                         pool="cpu", cpus=0.5)])
    with backend.launch(placement) as cluster:
        group = cluster.group("actor", ResultWorker)
        merged = run_shards(group, ResultWorker.log_probs, batch,
                            DispatchConfig(micro_batch_tokens=40), strategy=strategy)
    assert merged.batch.sample_ids.tolist() == batch.sample_ids.tolist()
    assert torch.equal(merged.batch.packed["logprobs"].values,
                       -(batch.packed["tokens"].values % 7).to(torch.float32))
    carried = {r.identity.rank: r.outputs is not None for r in merged.results}
    assert carried == {0: True, 1: False, 2: True, 3: False}  # tp = 0 ranks only
    assert all(r.spans for r in merged.results)  # every rank reports its spans
    assert merged.metrics["workers"].value == 4  # a per-rank metric, from every rank
    assert merged.metrics["num_tokens"].value == int(batch.total_lens.sum())
    assert [s.name for s in merged.driver_spans] == ["plan", "split", "submit", "wait",
                                                   "receive", "merge"]
