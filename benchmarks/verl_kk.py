"""Benchmark reference — verl's Karmarkar–Karp, re-expressed to compare avrid's partition with.

verl (0.9.x, `verl/utils/seqlen_balancing.py`, `get_seqlen_balanced_partitions`) balances
sequence lengths over data-parallel ranks with the largest differencing method, written the
straightforward way. This file restates that algorithm, with the same data structures and
the same tie-breaks, so that `bench_dispatch_verl.py` can set avrid's result and planning
time beside it without verl installed:

- items sorted ascending by (cost, position);
- ``equal_size``: consecutive chunks of k of that ascending list, one item per slot (needs
  n % k == 0, as verl asserts); otherwise one state per item;
- a state's k slots, each a list of (position, cost) with its sum, kept sorted heaviest first
  (slots compare by sum, then item count, then the item lists);
- a heap that pops the state of largest spread first (on equal spread, the one whose heaviest
  slot is larger); two popped states combine slot i with the other's slot k - 1 - i.

It is a measuring stick, not part of avrid (nothing in `avrid/` imports it).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class _Slot:
    """One shard being built: its items and their summed cost."""

    __slots__ = ("items", "total")

    def __init__(self) -> None:
        self.items: list[tuple[int, float]] = []
        self.total = 0.0

    def __lt__(self, other: _Slot) -> bool:
        if self.total != other.total:
            return self.total < other.total
        if len(self.items) != len(other.items):
            return len(self.items) < len(other.items)
        return self.items < other.items


class _State:
    """A partial partition: k slots, heaviest first."""

    __slots__ = ("slots",)

    def __init__(self, items: list[tuple[int, float]], k: int) -> None:
        self.slots = [_Slot() for _ in range(k)]
        for slot, (pos, cost) in zip(self.slots, items, strict=False):
            slot.items.append((pos, cost))
            slot.total += cost
        self.slots.sort(reverse=True)

    @property
    def spread(self) -> float:
        return self.slots[0].total - self.slots[-1].total

    def combine(self, other: _State) -> None:
        k = len(self.slots)
        for i in range(k):
            mine, theirs = self.slots[i], other.slots[k - 1 - i]
            mine.items.extend(theirs.items)
            mine.total += theirs.total
        self.slots.sort(reverse=True)

    def __lt__(self, other: _State) -> bool:  # heapq pops the smallest: largest spread first
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.slots[0] > other.slots[0]


def verl_kk(costs: Sequence[float], k: int, *, equal_size: bool) -> list[list[int]]:
    """Positions per shard as verl's `karmarkar_karp` would give them (each list ascending).

    Example:
        >>> verl_kk([8, 7, 6, 5, 4], 2, equal_size=False)
        [[1, 3, 4], [0, 2]]
    """
    if equal_size and len(costs) % k:
        raise ValueError(f"verl's equal-size KK needs n % k == 0, got n={len(costs)}, k={k}")
    ascending = sorted((float(c), i) for i, c in enumerate(costs))
    heap: list[_State] = []
    if equal_size:
        for start in range(0, len(ascending), k):
            chunk = [(i, c) for c, i in ascending[start:start + k]]
            heapq.heappush(heap, _State(chunk, k))
    else:
        for c, i in ascending:
            heapq.heappush(heap, _State([(i, c)], k))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.combine(second)
        heapq.heappush(heap, first)
    return [sorted(pos for pos, _ in slot.items) for slot in heap[0].slots]
