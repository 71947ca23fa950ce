"""Chapter 2 — plans remembered: the same batch shape over the same shards is planned once.

A plan depends on nothing but the batch's sample ids and token counts, the number of shards
and the `DispatchConfig` (the cost model sees only the lengths). A PPO step asks for the same
plan several times — the log-prob pass, the value pass and the reference pass all dispatch the
one scored batch; the critic's and the actor's updates cut the same mini-batches — and
Karmarkar–Karp over a few hundred samples costs about a millisecond of pure Python each time.
`cached_plan` keeps the last few plans by exactly what they depend on, so a repeat costs a
dictionary lookup (hashing the three id/length columns' bytes: microseconds):

    plan = cached_plan(batch, num_shards, config)   # make_plan's result, or the same again

A hit returns a plan equal to the one `make_plan` would make now, so results cannot change.
Only the built-in cost models (`TokenCost`, `FlopCost`) are cached: a `FunctionCost` runs
your code, which might not be a pure function of the lengths, so it is planned every time.
This file does not plan (`plan.py`) and does not send anything (`send.py`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

import torch

from avrid.dispatch.batch import Batch
from avrid.dispatch.cost import FlopCost, TokenCost
from avrid.dispatch.plan import DispatchConfig, DispatchPlan, make_plan

CACHE_SIZE = 16
"""Plans kept, least recently used dropped first: a step makes at most a handful of shapes
(the prompts, the scored batch, its mini-batches), so a few steps' worth fits."""

_plans: OrderedDict[Hashable, DispatchPlan] = OrderedDict()
_counts = {"hits": 0, "misses": 0}
_lock = threading.Lock()  # the concurrent controller plans from several driver threads


def cached_plan(batch: Batch, num_shards: int,
                config: DispatchConfig | None = None) -> DispatchPlan:
    """`make_plan(batch, num_shards, config)`, made once per distinct (sample ids, prompt
    lengths, response lengths, shard count, config) among the last `CACHE_SIZE`."""
    config = config or DispatchConfig()
    if not isinstance(config.cost, (TokenCost, FlopCost)):
        return make_plan(batch, num_shards, config)  # user code: maybe not pure, never cached
    # The bytes, not the values: equal tensors have equal bytes (int64, contiguous), and
    # hashing 3 x n x 8 bytes is far cheaper than turning them into Python ints.
    key = (num_shards, config, _raw(batch.sample_ids), _raw(batch.prompt_lens),
           _raw(batch.response_lens))
    with _lock:  # a lookup and its move, or an insert and its eviction, as one step
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
            _counts["hits"] += 1
            return plan
        _counts["misses"] += 1
        plan = _plans[key] = make_plan(batch, num_shards, config)  # errors are never cached
        if len(_plans) > CACHE_SIZE:
            _plans.popitem(last=False)
        return plan


def plan_cache_stats() -> dict[str, int]:
    """Hits and misses of `cached_plan` in this process so far, and the plans it holds."""
    return {**_counts, "size": len(_plans)}


def clear_plan_cache() -> None:
    """Forget every remembered plan (and reset the counts)."""
    _plans.clear()
    _counts.update(hits=0, misses=0)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()
