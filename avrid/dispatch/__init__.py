"""Chapter 2 — token-aware dispatch: which sequences go to which data-parallel shard and in
which micro-batches, so that no shard waits on another.

Read in this order: batch.py (the atomic unit and the packed batch), cost.py (what a sequence
costs), partition.py (Karmarkar–Karp, LPT, contiguous), microbatch.py (token budgets),
plan.py (the frozen, invertible plan), send.py (through a worker group by DP coordinate).
Everything but send.py is pure (no Ray) and runs anywhere.
"""

from avrid.dispatch.batch import Batch, Packed
from avrid.dispatch.cost import CostModel, FlopCost, FunctionCost, TokenCost, check_costs
from avrid.dispatch.microbatch import micro_batches, min_micro_batches
from avrid.dispatch.partition import (
    Partition,
    contiguous,
    greedy_lpt,
    karmarkar_karp,
    partition,
)
from avrid.dispatch.plan import DispatchConfig, DispatchPlan, Shard, make_plan
from avrid.dispatch.send import dispatch, send_shards, submit_shards

__all__ = [
    "Batch", "CostModel", "DispatchConfig", "DispatchPlan", "FlopCost", "FunctionCost",
    "Packed", "Partition", "Shard", "TokenCost", "check_costs", "contiguous", "dispatch",
    "greedy_lpt", "karmarkar_karp", "make_plan", "micro_batches", "min_micro_batches",
    "partition", "send_shards", "submit_shards",
]
