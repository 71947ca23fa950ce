"""Chapter 2 — sending a planned batch through a worker group, by data-parallel coordinate.

`dispatch(group, Worker.method, plan, batch)` splits the batch by the plan
(`shard_arguments`) and sends each shard once (`submit_per_rank`): a shard that several
ranks read (the tensor-parallel replicas of one DP shard) is stored once (`group.put`: the
Ray object store, or nothing to do in-process) and the *same handle* goes to each of them,
instead of the driver serialising it tp times (verl's `DP_COMPUTE` pickles the batch per
call); a shard that one rank reads goes inside its call.
It returns the answers of the collect ranks (one per shard, in shard order), ready for
`plan.restore`.

The worker's method receives a `Shard` and walks its micro-batches:

    class MyWorker(Worker):
        def log_probs(self, shard: Shard) -> Batch:
            outs = [forward(mb) for mb in shard.micro_batches()]
            ...

This file does not plan (`plan.py`) and does not merge rich results (chapter 3).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from avrid.dispatch.batch import Batch
from avrid.dispatch.plan import DispatchPlan
from avrid.workers import PendingCall, WorkerGroup

R = TypeVar("R")


def shard_arguments(group: WorkerGroup, plan: DispatchPlan, batch: Batch, *,
                    data_axis: str | None = None) -> list[Any]:
    """Split `batch` by `plan` into what each rank is passed, in rank order: its DP shard, or
    the handle of a shard stored once for the several ranks that read it.

    Raises:
        ValueError: the plan's shard count differs from the size of the mesh's data axis.
    """
    mesh = group.mesh
    axis = mesh.names[0] if data_axis is None else data_axis
    if plan.num_shards != mesh.axis_size(axis):
        raise ValueError(f"the plan has {plan.num_shards} shards but {group.role}'s mesh "
                         f"({mesh}) has {mesh.axis_size(axis)} ranks along {axis!r}")
    shard_of = [mesh.coords(r)[axis] for r in range(group.world_size)]
    readers = Counter(shard_of)
    # A shard several ranks read (the TP replicas of one DP shard) is stored once and shared.
    # One that a single rank reads goes inside its call: Ray inlines a small argument and
    # stores a large one itself, so storing it first would only add a round trip.
    handles = [group.put(shard) if readers[i] > 1 else shard
               for i, shard in enumerate(plan.split(batch))]
    return [handles[s] for s in shard_of]


def submit_shards(group: WorkerGroup, method: Callable[..., R], plan: DispatchPlan,
                  batch: Batch, *args: Any, data_axis: str | None = None,
                  **kwargs: Any) -> PendingCall[R]:
    """Start ``method(shard, *args, **kwargs)`` on every rank with its DP shard and return at
    once; ``.result()`` gives every rank's answer in rank order.

    Raises:
        ValueError: the plan's shard count differs from the size of the mesh's data axis.
    """
    per_rank = shard_arguments(group, plan, batch, data_axis=data_axis)
    return submit_per_rank(group, method, per_rank, *args, **kwargs)


def submit_per_rank(group: WorkerGroup, method: Callable[..., R], per_rank: Sequence[Any],
                    *args: Any, **kwargs: Any) -> PendingCall[R]:
    """Start ``method(per_rank[r], *args, **kwargs)`` on every rank r (the arguments after
    the first are the same for every rank) and return at once."""
    n = group.world_size
    return group.submit_per_rank(method, per_rank, *[[a] * n for a in args],
                                 **{k: [v] * n for k, v in kwargs.items()})


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
