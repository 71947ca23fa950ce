"""Chapter 3 — one call from the driver: plan a batch, send the shards, merge the results.

`run_shards(group, Worker.method, batch, config)` is the whole round trip of a
single-controller step for one role, with the driver's own time recorded as spans so the
timeline shows where the driver (not just the workers) spends a step:

    plan      make the chapter 2 dispatch plan (or find it made: `cached_plan`)
    split     cut the batch into one shard per DP rank (stored once when ranks share one)
    submit    call every rank: each shard is pickled into its call here (`call_wire`)
    wait      until every rank has answered (the workers' compute and the bubbles live here)
    receive   fetch and unpickle every rank's `WorkerResult`
    merge     check and combine the canonical results

Inside the call each rank records its own side (`ResultBuilder`): ``unpack`` before its first
compute span, the compute spans, ``pack`` after the last; what lies between the driver's
``submit`` and a rank's ``unpack`` is the transport in (Ray's dispatch and unpickling the
shard), between its ``pack`` and the end of ``wait`` the transport out.

`start_shards` is the same call cut in two — plan, split and submit now; wait, receive and
merge on `.result()` — for a driver that keeps two groups busy at once.

The method must take a `Shard` and return a `WorkerResult` (built with `ResultBuilder`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from avrid.dispatch import (
    Batch,
    DispatchConfig,
    DispatchPlan,
    cached_plan,
    shard_arguments,
    submit_per_rank,
)
from avrid.results.merge import Merged, merge
from avrid.results.result import Span, WorkerResult
from avrid.workers import PendingCall, WorkerGroup


def run_shards(group: WorkerGroup, method: Callable[..., WorkerResult], batch: Batch,
               config: DispatchConfig | None = None, *args: Any,
               plan: DispatchPlan | None = None, data_axis: str | None = None,
               **kwargs: Any) -> Merged:
    """Dispatch `batch` over `group`'s data-parallel shards and merge what comes back.

    Pass `plan` to use one you made; otherwise one is made from `config` (`cached_plan`: a
    batch with the same ids and lengths as a recent one reuses its plan). Extra arguments go
    to every rank's `method` after the shard.
    """
    return start_shards(group, method, batch, config, *args, plan=plan, data_axis=data_axis,
                        **kwargs).result()


def start_shards(group: WorkerGroup, method: Callable[..., WorkerResult], batch: Batch,
                 config: DispatchConfig | None = None, *args: Any,
                 plan: DispatchPlan | None = None, data_axis: str | None = None,
                 **kwargs: Any) -> ShardCall:
    """`run_shards`' first half: plan, split and submit, then return at once, so that the
    driver can start another group's work (chapter 6 generates while it trains); `.result()`
    waits, receives and merges."""
    if config is not None and not isinstance(config, DispatchConfig):
        raise TypeError(f"run_shards: the 4th argument is the DispatchConfig (or None), got "
                        f"{config!r}; pass the method's own arguments after it or by keyword")
    spans = []
    t = time.time()
    axis = group.mesh.names[0] if data_axis is None else data_axis
    if plan is None:
        # The same ids and lengths over the same shards (the value pass after the log-prob
        # pass, the actor's mini-batches after the critic's) are planned once.
        plan = cached_plan(batch, group.mesh.axis_size(axis), config)
    spans.append(Span(name="plan", start=t, end=(t := time.time())))
    per_rank = shard_arguments(group, plan, batch, data_axis=axis)
    spans.append(Span(name="split", start=t, end=(t := time.time())))
    pending = submit_per_rank(group, method, per_rank, *args, **kwargs)
    spans.append(Span(name="submit", start=t, end=time.time()))
    return ShardCall(group=group, plan=plan, pending=pending, axis=axis, spans=spans)


@dataclass(slots=True, kw_only=True)
class ShardCall:
    """A `start_shards` call in flight: every rank has its shard; nothing is gathered yet."""

    group: WorkerGroup
    plan: DispatchPlan
    pending: PendingCall[WorkerResult]
    axis: str
    spans: list[Span]
    """The driver's spans so far (plan, split, submit); `result` adds wait, receive and
    merge."""

    def done(self) -> bool:
        """Whether every rank has answered (`result` would not wait)."""
        return self.pending.done()

    def result(self) -> Merged:
        """Wait for every rank (at most the group's call timeout) and merge, in batch order."""
        t = time.time()
        self.pending.wait(self.group.call_timeout_s)
        self.spans.append(Span(name="wait", start=t, end=(t := time.time())))
        results = self.pending.result()  # every rank has finished: this only fetches
        self.spans.append(Span(name="receive", start=t, end=(t := time.time())))
        merged = merge(self.plan, results, data_axis=self.axis)
        self.spans.append(Span(name="merge", start=t, end=time.time()))
        return Merged(batch=merged.batch, metrics=merged.metrics, results=merged.results,
                      driver_spans=tuple(self.spans))
