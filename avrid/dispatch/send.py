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
from avrid.workers import PendingCall, WorkerGroup

R = TypeVar("R")


def submit_shards(group: WorkerGroup, method: Callable[..., R], plan: DispatchPlan,
                  batch: Batch, *args: Any, data_axis: str | None = None,
                  **kwargs: Any) -> PendingCall[R]:
    """Start ``method(shard, *args, **kwargs)`` on every rank with its DP shard and return at
    once; ``.result()`` gives every rank's answer in rank order.

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
    return group.submit_per_rank(method, per_rank, *same,
                                 **{k: [v] * group.world_size for k, v in kwargs.items()})


def send_shards(group: WorkerGroup, method: Callable[..., R], plan: DispatchPlan,
                batch: Batch, *args: Any, data_axis: str | None = None,
                **kwargs: Any) -> list[R]:
    """`submit_shards` and wait: every rank's result, in rank order (chapter 3 merges them
    all, since spans come from every rank)."""
    pending = submit_shards(group, method, plan, batch, *args, data_axis=data_axis, **kwargs)
    return pending.result(group.call_timeout_s)


def dispatch(group: WorkerGroup, method: Callable[..., R], plan: DispatchPlan, batch: Batch,
             *args: Any, data_axis: str | None = None, **kwargs: Any) -> list[R]:
    """Like `send_shards`, but return only the collect ranks' results (one per shard, in
    shard order), ready for ``plan.restore``."""
    results = send_shards(group, method, plan, batch, *args, data_axis=data_axis, **kwargs)
    axis = group.mesh.names[0] if data_axis is None else data_axis
    return [results[r] for r in group.mesh.collect_ranks(axis)]
