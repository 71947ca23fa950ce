"""Chapter 2 — sending a planned batch through a worker group, by data-parallel coordinate.

`dispatch(group, Worker.method, plan, batch)` splits the batch by the plan, stores each shard
once (`group.put`: the Ray object store, or nothing to do in-process) and hands the *same
handle* to every rank whose data-parallel coordinate is that shard — the tensor-parallel
replicas of one shard share one copy instead of the driver serialising it tp times (verl's
`DP_COMPUTE` pickles the batch per call). It returns the answers of the collect ranks (one per
shard, in shard order), ready for `plan.restore`.

The worker's method receives a `Shard` and walks its micro-batches:

    class MyWorker(Worker):
        def log_probs(self, shard: Shard) -> Batch:
            outs = [forward(mb) for mb in shard.micro_batches()]
            ...

This file does not plan (`plan.py`) and does not merge rich results (chapter 3).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from avrid.dispatch.batch import Batch
from avrid.dispatch.plan import DispatchPlan
from avrid.workers import WorkerGroup

R = TypeVar("R")


def dispatch(group: WorkerGroup, method: Callable[..., R], plan: DispatchPlan, batch: Batch,
             *args: Any, data_axis: str | None = None, **kwargs: Any) -> list[R]:
    """Run ``method(shard, *args, **kwargs)`` on every rank with its DP shard; return the
    collect ranks' results in shard order.

    Raises:
        ValueError: the plan's shard count differs from the size of the mesh's data axis.
    """
    mesh = group.mesh
    axis = mesh.names[0] if data_axis is None else data_axis
    if plan.num_shards != mesh.axis_size(axis):
        raise ValueError(f"the plan has {plan.num_shards} shards but {group.role}'s mesh "
                         f"({mesh}) has {mesh.axis_size(axis)} ranks along {axis!r}")
    handles = [group.put(shard) for shard in plan.split(batch)]  # each shard stored once
    per_rank = [handles[mesh.coords(r)[axis]] for r in range(group.world_size)]
    same = [[a] * group.world_size for a in args]
    results = group.call_per_rank(method, per_rank, *same,
                                  **{k: [v] * group.world_size for k, v in kwargs.items()})
    return [results[r] for r in mesh.collect_ranks(axis)]
