"""Chapter 2 — balanced partitioning: spread per-sequence costs over k data-parallel shards.

A training step waits for its slowest shard, so the goal is the smallest *maximum* shard cost
(multiway number partitioning; NP-hard, but good heuristics land within a hair of the bound).
Three partitioners, all returning a frozen `Partition`:

- `karmarkar_karp`: the largest differencing method (LDM). Best in practice, within ~0.05% of
  the lower bound on long-tailed RL rollouts, and fast enough to run every step.
- `greedy_lpt`: longest processing time first. Simple, provably max <= total/k + largest
  cost, usually a little worse than LDM.
- `contiguous`: the naive baseline, consecutive runs of equal count, blind to cost.

Every partitioner takes any n >= 1 over any k >= 1 (no divisibility rule; n < k leaves shards
empty), can give every shard the same number of samples (±1, `equal_count=True`), breaks ties
by position so the same input always gives the same output, and reports the lower bound
max(total / k, largest cost) that no partition can beat. This module is pure (numpy and the
standard library); Karmarkar–Karp's differencing loops are in `differencing.py`. It does not
cost sequences (`cost.py`), cut micro-batches (`microbatch.py`) or move data (`plan.py`,
`send.py`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from avrid.dispatch.cost import check_costs
from avrid.dispatch.differencing import classic_is_chunked, ldm_labels
from avrid.dispatch.refine import refine

Method = Literal["kk", "lpt", "contiguous"]
METHODS: tuple[str, ...] = ("kk", "lpt", "contiguous")
Costs = Sequence[float] | np.ndarray


@dataclass(frozen=True, slots=True, kw_only=True)
class Partition:
    """Which input positions each shard gets, what each shard costs, and how good that is.

    Example:
        >>> p = greedy_lpt([8, 7, 6, 5, 4], 2)
        >>> p.shards, p.costs, p.lower_bound
        (((0, 3, 4), (1, 2)), (17.0, 13.0), 15.0)

    (The optimum here is 8+7 | 6+5+4 = 15 | 15, which `karmarkar_karp` finds: the partitioners
    are heuristics, and the lower bound is what they are measured against.)
    """

    method: str
    """The partitioner that made it: "kk", "lpt" or "contiguous"."""
    equal_count: bool
    """Whether shard sizes were constrained to differ by at most one (always, for
    "contiguous")."""
    shards: tuple[tuple[int, ...], ...]
    """Per shard, positions into the input costs, ascending; empty tuple for an empty shard."""
    costs: tuple[float, ...]
    """Per shard, the sum of its samples' costs (0.0 for an empty shard)."""
    lower_bound: float
    """max(total / k, largest cost): no partition into k shards has a smaller maximum."""

    def __post_init__(self) -> None:
        if not self.shards or len(self.shards) != len(self.costs):
            raise ValueError(f"a Partition needs at least one shard and one cost per shard, "
                             f"got {len(self.shards)} shards and {len(self.costs)} costs")

    @property
    def num_shards(self) -> int:
        """k, the number of shards (empty ones included)."""
        return len(self.shards)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Number of samples in each shard."""
        return tuple(len(s) for s in self.shards)

    @property
    def max_cost(self) -> float:
        """Cost of the most expensive shard: what a synchronous step waits for."""
        return max(self.costs)

    @property
    def imbalance(self) -> float:
        """max_cost / lower_bound (1.0 is optimal; 1.0 when every cost is zero)."""
        return self.max_cost / self.lower_bound if self.lower_bound > 0 else 1.0

    def describe(self) -> str:
        """A short text table: one line per shard with its size, cost and cost / bound."""
        lb = self.lower_bound
        method = f"{self.method} (equal count)" if self.equal_count else self.method
        lines = [f"{method}: {sum(self.sizes)} samples over {self.num_shards} shards, "
                 f"lower bound {lb:.6g}, max / lower bound {self.imbalance:.4f}",
                 f"{'shard':>6} {'samples':>8} {'cost':>12} {'/ bound':>8}"]
        for i, (size, cost) in enumerate(zip(self.sizes, self.costs, strict=True)):
            lines.append(f"{i:>6} {size:>8} {cost:>12.6g} {cost / lb if lb > 0 else 1.0:>8.4f}")
        return "\n".join(lines)


def karmarkar_karp(costs: Costs, k: int, *, equal_count: bool = False) -> Partition:
    """k-way Karmarkar–Karp largest differencing method (LDM).

    The idea: keep a collection of *partial partitions*, each a k-slot state (slot = shard
    being built, with its summed cost) whose slots are sorted heaviest first. At the start every
    item is its own state: one slot holds it, the others are empty. Repeatedly take the two
    states with the largest *spread* (heaviest slot minus lightest slot), combine them by
    putting the heaviest slot of one together with the lightest slot of the other, second
    heaviest with second lightest, and so on, and put the result back. Pairing large with small
    cancels the two spreads against each other, so the combined spread is never larger than
    either (it is usually much smaller). Deciding the largest, hardest-to-place items first,
    while there is still plenty of room to even them out, is what makes LDM beat greedy. When
    one state is left, its k slots are the k shards.

    Two natural starting points: every item alone (classic LDM), or the descending-sorted
    items cut into consecutive chunks of k, one item per slot (balanced LDM). Every combine
    pairs slot with slot, so from chunks each final shard holds exactly one item per chunk:
    counts differ by at most one (only the last chunk can be short, as if padded with zero-cost
    dummies). That is the ``equal_count=True`` result. Neither start wins everywhere: chunks do
    better with few items per shard (on 1024 long-tailed rollouts over 64 shards classic LDM
    lands up to ~1.005 of the bound, chunks ~1.0004), singletons when a few huge items should
    sit alone. So without `equal_count` both run and the lower maximum wins (ties go to the
    chunked result, whose counts are also even), about doubling the time. Except where the
    classic run provably repeats the chunked one, as it does on token counts with many ties
    (`differencing.classic_is_chunked`): then its result is known, and it is not run.

    Last, `refine.refine` swaps items between the heaviest shard and a lighter one while that
    lowers the heaviest (and, without `equal_count`, moves single items): LDM never revisits
    a decision, and on long-tailed rollouts one or two exchanges often take the last 1e-5 of
    the bound. A result no exchange improves is returned exactly as LDM made it.

    Guarantee: a combine never increases the spread, so the final max - min <= largest cost,
    hence max <= total / k + (1 - 1/k) * largest cost. Runs in O(n k log k) time at worst, far
    less in practice: 4096 items over 64 shards take a few milliseconds; 256 items over two
    shards, which have a loop of their own, 0.1 to 0.4 ms. The loops are in `differencing.py`.
    """
    c, k = _validated(costs, k)
    n = len(c)
    if k == 1:  # one shard holds everything, in position order, whatever the method
        return _build("kk", c, np.zeros(n, dtype=np.int64), 1, equal_count)
    # Descending by cost, ties by position (a stable sort of -c): this fixes every later tie.
    positions = np.argsort(-c, kind="stable")
    if n <= k:  # either start leaves every item alone: shard i gets the i-th largest item
        labels = np.empty(n, dtype=np.int64)
        labels[positions] = np.arange(n)
        return _build("kk", c, labels, k, equal_count)
    sorted_costs = c[positions]
    order, desc = positions.tolist(), sorted_costs.tolist()
    labels = ldm_labels(desc, order, k, chunked=True)
    if not equal_count and not classic_is_chunked(sorted_costs, k):
        classic = ldm_labels(desc, order, k, chunked=False)
        if (np.bincount(classic, weights=c, minlength=k).max()
                < np.bincount(labels, weights=c, minlength=k).max()):
            labels = classic
    # LDM never revisits a decision; pairwise exchanges polish what it left (`refine.py`).
    # Kept only where they lower the heaviest shard, so a partition already as good as they
    # can make it is returned as LDM made it.
    labels = refine(c, labels, k, allow_moves=not equal_count)
    return _build("kk", c, labels, k, equal_count)


def greedy_lpt(costs: Costs, k: int, *, equal_count: bool = False) -> Partition:
    """Longest processing time first: each item, largest first, goes to the lightest shard.

    Ties between equally light shards go to the one with fewer samples, then the lower index
    (so zero-cost items spread out instead of piling up). Guarantee: the last item added to the
    heaviest shard found it lightest, so max <= total / k + (1 - 1/k) * largest cost.

    With ``equal_count=True`` a shard stops taking items at its quota: exactly n mod k shards
    (the first to get there) end with ceil(n / k) items and the rest with floor(n / k). The
    guarantee above does not hold under that constraint.
    """
    c, k = _validated(costs, k)
    n = len(c)
    order = np.argsort(-c, kind="stable").tolist()
    cost = c.tolist()
    q, r = divmod(n, k)
    # Without the constraint every shard may take all n items.
    quota = (q + 1 if r else q) if equal_count else n
    at_ceiling = 0
    labels = [0] * n
    # One entry per shard: (load, samples, shard); already a heap. The lightest shard is on
    # top, on equal load the one with fewer samples, then the lower index.
    heap = [(0.0, 0, s) for s in range(k)]
    for pos in order:
        # Lazily drop shards that reached their quota (the quota may have just shrunk).
        while heap[0][1] >= quota:
            heapq.heappop(heap)
        load, size, s = heap[0]
        labels[pos] = s
        heapq.heapreplace(heap, (load + cost[pos], size + 1, s))
        if equal_count and r and size + 1 == q + 1:
            at_ceiling += 1
            if at_ceiling == r:
                quota = q  # the n mod k larger shards are taken; the rest stop at floor(n / k)
    return _build("lpt", c, np.asarray(labels, dtype=np.int64), k, equal_count)


def contiguous(costs: Costs, k: int, *, equal_count: bool = False) -> Partition:
    """The naive baseline: positions in order, cut into k runs of near-equal count.

    The first n mod k shards get one extra sample (as ``numpy.array_split``). Costs are
    ignored, so one shard can collect all the long sequences. Counts are equal by
    construction, so `equal_count` changes nothing (it is accepted for a uniform signature).
    """
    c, k = _validated(costs, k)
    q, r = divmod(len(c), k)
    sizes = [q + 1] * r + [q] * (k - r)
    labels = np.repeat(np.arange(k, dtype=np.int64), sizes)
    return _build("contiguous", c, labels, k, True)


_PARTITIONERS: dict[str, Callable[..., Partition]] = {
    "kk": karmarkar_karp, "lpt": greedy_lpt, "contiguous": contiguous}


def partition(costs: Costs, k: int, method: Method = "kk", *,
              equal_count: bool = False) -> Partition:
    """Partition `costs` into `k` shards with the named method ("kk", "lpt", "contiguous").

    Raises:
        ValueError: an unknown method (the message lists the allowed ones), k that is not an
            integer >= 1, an empty batch, or NaN, infinite or negative costs.
    """
    if method not in _PARTITIONERS:
        raise ValueError(f"unknown partition method {method!r}; allowed: {METHODS}")
    return _PARTITIONERS[method](costs, k, equal_count=equal_count)


def _validated(costs: Costs, k: int) -> tuple[np.ndarray, int]:
    """Checked float64 costs and k as a plain int; every bad input fails here, by name."""
    if not isinstance(k, int | np.integer) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k (the number of shards) must be an integer >= 1, got {k!r}")
    c = check_costs(costs)
    if len(c) == 0:
        raise ValueError("an empty batch cannot be partitioned: costs has no samples "
                         "(need at least one)")
    return c, int(k)


def _build(method: str, c: np.ndarray, labels: np.ndarray, k: int,
           equal_count: bool) -> Partition:
    """The `Partition` for shard labels per position: positions grouped, ascending."""
    # A stable sort by label keeps positions ascending inside each shard.
    grouped = np.argsort(labels, kind="stable")
    bounds = np.cumsum(np.bincount(labels, minlength=k)).tolist()
    flat = grouped.tolist()
    shards = tuple(tuple(flat[lo:hi]) for lo, hi in zip([0, *bounds[:-1]], bounds, strict=True))
    sums = np.bincount(labels, weights=c, minlength=k)
    lower_bound = max(float(c.sum()) / k, float(c.max()))
    return Partition(method=method, equal_count=equal_count, shards=shards,
                     costs=tuple(sums.tolist()), lower_bound=lower_bound)
