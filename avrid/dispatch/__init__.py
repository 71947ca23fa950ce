"""Chapter 2 — token-aware dispatch: which sequences go to which data-parallel shard and in
which micro-batches, so that no shard waits on another.

Read in this order: batch.py (the atomic unit and the packed batch), cost.py (what a sequence
costs), partition.py (Karmarkar–Karp, LPT, contiguous), differencing.py (how Karmarkar–Karp
runs, fast), refine.py (exchanges that polish its result), microbatch.py (token budgets),
plan.py (the frozen, invertible plan), plan_cache.py (the same shape planned once),
send.py (through a worker group by DP coordinate).
Everything but send.py is pure (no Ray) and runs anywhere.

cost.py, partition.py, differencing.py and microbatch.py need only numpy, so the planning maths
imports in a blink with a plain ``pip install avrid``; batches, plans and sending need torch
(``pip install 'avrid[torch]'``) and are loaded on first use (see `__getattr__` below).
"""

import importlib
from typing import TYPE_CHECKING, Any

from avrid.dispatch.cost import CostModel, FlopCost, FunctionCost, TokenCost, check_costs
from avrid.dispatch.microbatch import micro_batches, min_micro_batches
from avrid.dispatch.partition import (
    Partition,
    contiguous,
    greedy_lpt,
    karmarkar_karp,
    partition,
)

if TYPE_CHECKING:  # what type checkers and editors see; at run time `__getattr__` loads these
    from avrid.dispatch.batch import Batch, Packed
    from avrid.dispatch.plan import DispatchConfig, DispatchPlan, Shard, make_plan
    from avrid.dispatch.plan_cache import cached_plan
    from avrid.dispatch.send import (
        dispatch,
        send_shards,
        shard_arguments,
        submit_per_rank,
        submit_shards,
    )

__all__ = [
    "Batch", "CostModel", "DispatchConfig", "DispatchPlan", "FlopCost", "FunctionCost",
    "Packed", "Partition", "Shard", "TokenCost", "cached_plan", "check_costs", "contiguous",
    "dispatch",
    "greedy_lpt", "karmarkar_karp", "make_plan", "micro_batches", "min_micro_batches",
    "partition", "send_shards", "shard_arguments", "submit_per_rank", "submit_shards",
]

_NEEDS_TORCH = {
    "Batch": "avrid.dispatch.batch", "Packed": "avrid.dispatch.batch",
    "DispatchConfig": "avrid.dispatch.plan", "DispatchPlan": "avrid.dispatch.plan",
    "Shard": "avrid.dispatch.plan", "make_plan": "avrid.dispatch.plan",
    "cached_plan": "avrid.dispatch.plan_cache",
    "dispatch": "avrid.dispatch.send", "send_shards": "avrid.dispatch.send",
    "submit_shards": "avrid.dispatch.send", "shard_arguments": "avrid.dispatch.send",
    "submit_per_rank": "avrid.dispatch.send",
}
"""The public names whose module imports torch, and that module."""


def __getattr__(name: str) -> Any:
    # `import torch` costs 1-3 s (and torch is an extra), and Python imports this package
    # before any of its modules, so importing batch.py here would make even
    # `import avrid.dispatch.partition` pay for torch. Instead, Python calls a module's
    # `__getattr__` for a name the module does not define (PEP 562): the first
    # `from avrid.dispatch import Batch` lands here and imports batch.py then; later ones
    # find the module already in sys.modules and cost a dictionary lookup.
    if name not in _NEEDS_TORCH:
        raise AttributeError(f"module 'avrid.dispatch' has no attribute {name!r}")
    try:
        module = importlib.import_module(_NEEDS_TORCH[name])
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise ModuleNotFoundError(f"avrid.dispatch.{name} needs torch: "
                                  f"pip install 'avrid[torch]'", name="torch") from e
    return getattr(module, name)
