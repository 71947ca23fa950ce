"""Chapter 2 — micro-batches inside one shard, cut by a token budget.

A worker cannot run its whole shard at once: activations grow with the tokens in a forward
pass. So the shard is cut into micro-batches of at most `budget` tokens each (verl's
`ppo_max_token_len_per_gpu`). Fewer, fuller micro-batches are faster; balanced ones waste less.
Here: the fewest micro-batches that fit (found by trying m = lower bound, m + 1, ...), with the
samples spread over them by the greedy longest-first rule, so they are also balanced.

Two options, both needed by real trainers:
- `num_micro`: force exactly this many micro-batches (FSDP's collectives need every DP rank
  to run the same number of forward/backward passes, so shards are equalised to the largest
  count; a shard with fewer samples than that gets empty micro-batches).
- `oversize`: a sequence longer than the budget is its own micro-batch ("own") or an error.

Pure numpy; knows nothing of batches or workers (`plan.py` applies this to every shard).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

Oversize = Literal["own", "error"]


def micro_batches(lengths: Sequence[int] | np.ndarray, budget: int, *,
                  num_micro: int | None = None,
                  oversize: Oversize = "own") -> list[list[int]]:
    """Group positions 0..n-1 of one shard into micro-batches of at most `budget` tokens.

    Returns a list of micro-batches, each a list of positions in ascending order; micro-batches
    are ordered by their first position (empty ones last). With `num_micro`, exactly that many
    are returned (raising if they cannot fit); otherwise the fewest that fit, and at least one
    (an empty shard gets one empty micro-batch).

    Raises:
        ValueError: a budget below 1, an unknown `oversize` policy, a sequence longer than the
            budget under ``oversize="error"``, or a `num_micro` too small to fit the shard.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    if budget < 1:
        raise ValueError(f"the micro-batch token budget must be >= 1, got {budget}")
    if oversize not in ("own", "error"):
        raise ValueError(f"oversize must be 'own' or 'error', got {oversize!r}")
    too_long = np.flatnonzero(lens > budget)
    if len(too_long) and oversize == "error":
        i = int(too_long[0])
        raise ValueError(f"position {i} has {int(lens[i])} tokens, over the micro-batch budget "
                         f"of {budget} ({len(too_long)} such sequences); raise the budget or "
                         f"use oversize='own'")
    # `min_micro_batches`, with its mask skipped when no sequence is oversize.
    need = (min_micro_batches(lens, budget) if len(too_long)
            else math.ceil(int(lens.sum()) / budget))
    if num_micro is not None and num_micro < need:
        raise ValueError(f"{num_micro} micro-batches cannot hold this shard's {len(lens)} "
                         f"sequences ({int(lens.sum())} tokens) under a budget of {budget}; "
                         f"it needs at least {need}")
    # At least one micro-batch, even for an empty shard: its worker still runs one (empty)
    # step, so that code after the loop and FSDP's collectives need no special case.
    m = max(need, 1) if num_micro is None else num_micro
    if m == 1 and not len(too_long):
        # The whole shard fits in one micro-batch (need <= 1 means its tokens are within the
        # budget): the spread below would put every position into it, so skip the sort.
        return [list(range(len(lens)))]
    # Plain Python lists from here: shards are small and numpy's per-element access is slow.
    sizes = lens.tolist()
    longest_first = [i for i in np.argsort(-lens, kind="stable").tolist() if sizes[i] <= budget]
    alone = too_long.tolist()
    while True:
        groups = _spread(sizes, longest_first, alone, budget, m)
        if groups is not None:
            return groups
        if num_micro is not None:
            raise ValueError(f"the longest-first spread could not fit this shard's "
                             f"{len(lens)} sequences into {num_micro} micro-batches of "
                             f"{budget} tokens")
        m += 1  # the greedy spread overflowed a micro-batch: allow one more (m = n always fits)


def min_micro_batches(lengths: Sequence[int] | np.ndarray, budget: int) -> int:
    """A lower bound on the micro-batches a shard needs: each oversize sequence alone, the
    rest at least ceil(tokens / budget); 0 for an empty shard."""
    lens = np.asarray(lengths, dtype=np.int64)
    fits = lens[lens <= budget]
    return int((lens > budget).sum()) + math.ceil(int(fits.sum()) / budget)


def _spread(sizes: list[int], longest_first: list[int], alone: list[int], budget: int,
            m: int) -> list[list[int]] | None:
    """Longest-first greedy into `m` micro-batches (oversize ones alone); None on overflow."""
    free = m - len(alone)
    if free < 0 or (longest_first and free == 0):
        return None
    heap = [(0, j) for j in range(free)]  # (tokens so far, micro-batch index)
    bins: list[list[int]] = [[] for _ in range(free)]
    for i in longest_first:
        load, j = heap[0]
        load += sizes[i]
        if load > budget:
            return None
        bins[j].append(i)
        heapq.heapreplace(heap, (load, j))
    groups = [[i] for i in alone] + bins
    for g in groups:
        g.sort()
    return sorted(groups, key=lambda g: (not g, g[0] if g else 0))
