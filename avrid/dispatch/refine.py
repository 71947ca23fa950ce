"""Chapter 2 — exchange refinement: polish a partition by swapping items between two shards.

Karmarkar–Karp (`partition.karmarkar_karp`) decides each item once and never looks back, so
its result can sit a hair above what one small change would give: the heaviest shard holds a
item of 1500 tokens where the lightest holds one of 1480, and swapping them would take 10
tokens off the step's slowest shard. `refine` makes such changes until none is left:

- take the heaviest shard h and the other shards from lightest up;
- for a shard s lighter by `gap`, find an item a of h and an item b of s with
  0 < cost(a) - cost(b) < gap (swapping them lowers h and raises s by less than the gap, so
  neither ends at h's old load), choosing the pair whose difference is nearest gap / 2 (the
  most even result); without an equal-count rule, b may also be "nothing" (a move);
- apply the first such exchange found and start again; stop when no shard offers one.

Every exchange lowers the sum of squared shard loads (by 2d(gap - d) > 0 for a difference d),
so it cannot cycle; `max_rounds` bounds the work anyway. The result is kept only if its
heaviest shard is strictly lighter than the input's: a partition that is already as good is
returned unchanged, position for position, so refinement never moves a sample for nothing.
Swaps keep every shard's count, so an equal-count partition stays one.

What this file is not: a partitioner of its own (it starts from one), or an exact solver
(a swap of one pair is a local step; the lower bound may stay out of reach). Pure numpy.
"""

from __future__ import annotations

import numpy as np


def refine(costs: np.ndarray, labels: np.ndarray, k: int, *, allow_moves: bool,
           max_rounds: int | None = None) -> np.ndarray:
    """`labels` (each position's shard, 0..k-1) improved by exchanges; the same array when no
    exchange lowers the heaviest shard.

    Args:
        costs: float64 cost per position, finite and >= 0 (already checked by the caller).
        labels: int64 shard per position, from a partitioner.
        k: the number of shards.
        allow_moves: whether an item may move to a shard without one coming back (False for
            an equal-count partition, whose counts swaps keep).
        max_rounds: at most this many exchanges (default 8: each is some thirty numpy calls
            over the batch, and the first few take nearly all there is to gain; Karmarkar–Karp
            must stay a small share of a step's planning).

    Example:
        >>> import numpy as np
        >>> c = np.array([8.0, 7.0, 6.0, 5.0, 4.0])
        >>> refine(c, np.array([1, 0, 1, 0, 0]), 2, allow_moves=False).tolist()  # 16|14 -> 15|15
        [1, 1, 0, 0, 0]
    """
    rounds = 8 if max_rounds is None else max_rounds
    out = labels.copy()
    loads = np.bincount(out, weights=costs, minlength=k)
    start_max = float(loads.max())
    if start_max <= max(float(loads.sum()) / k, float(costs.max())):
        return labels  # at the lower bound already: nothing can be lighter
    changed = False
    for _ in range(rounds):
        found = _best_exchange(costs, out, loads, k, allow_moves)
        if found is None:
            break
        h, s, a, b = found
        changed = True
        out[a] = s
        if b >= 0:
            out[b] = h
        # Summed again, not updated by the difference: float rounding must not accumulate.
        loads[h] = costs[out == h].sum()
        loads[s] = costs[out == s].sum()
    if not changed or not float(loads.max()) < start_max:
        return labels
    return out


def _best_exchange(costs: np.ndarray, labels: np.ndarray, loads: np.ndarray, k: int,
                   allow_moves: bool) -> tuple[int, int, int, int] | None:
    """(heaviest shard h, other shard s, position leaving h, position leaving s or -1 for a
    move) of the exchange that leaves the pair's heavier side lightest; None if none helps.

    All other shards at once: for every item b outside h, the items of h whose cost lies
    nearest cost(b) + gap / 2 (found by one binary search in h's sorted costs) are the
    partners that split the pair's gap most evenly. Ties go to the lowest position.
    """
    h = int(np.argmax(loads))
    in_h = labels == h
    a_pos = np.flatnonzero(in_h)
    if len(a_pos) == 0:
        return None
    a_order = np.argsort(costs[a_pos], kind="stable")
    a_pos, a = a_pos[a_order], costs[a_pos[a_order]]
    b_pos = np.flatnonzero(~in_h)
    b, b_shard = costs[b_pos], labels[b_pos]
    if allow_moves:  # "nothing", cost 0, as a partner in every other shard: a move
        others = np.array([s for s in range(k) if s != h], dtype=np.int64)
        b_pos = np.concatenate((b_pos, np.full(len(others), -1)))
        b = np.concatenate((b, np.zeros(len(others))))
        b_shard = np.concatenate((b_shard, others))
    if len(b_pos) == 0:
        return None
    gap = loads[h] - loads[b_shard]
    at = np.searchsorted(a, b + gap / 2.0)
    best_value, best = np.inf, None
    for cand in (np.clip(at - 1, 0, len(a) - 1), np.clip(at, 0, len(a) - 1)):
        d = a[cand] - b
        ok = (d > 0.0) & (d < gap)
        if not ok.any():
            continue
        # The pair's heavier side after the exchange: below loads[h] exactly when ok.
        value = np.where(ok, np.maximum(loads[h] - d, loads[b_shard] + d), np.inf)
        j = int(np.argmin(value))
        if value[j] < best_value:
            best_value = float(value[j])
            best = (h, int(b_shard[j]), int(a_pos[cand[j]]), int(b_pos[j]))
    return best
