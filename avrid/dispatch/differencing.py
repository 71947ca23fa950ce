"""Chapter 2 — the engine of Karmarkar–Karp: the largest differencing method, step by step.

`partition.karmarkar_karp` explains the idea and picks the result; this module runs it. From
the descending costs and their positions, `ldm_labels` builds the starting states (chunks of
k sorted items, or every item alone), repeatedly combines the two states of largest spread,
and returns each position's shard. Every combined slot is recorded as a new node with two
halves, so the final slots are walked back down to the input positions.

Three things keep it fast in pure Python, all with results identical to the plain loop:
- `_differencing` stores only a state's occupied slots and takes single items from a sorted
  list rather than from the heap;
- two shards, the common case, get a loop of their own, `_differencing_two`;
- `classic_is_chunked` spots inputs where the classic start provably repeats the chunked one
  (the usual case for token counts, with their many ties), so it need not run.

Pure: numpy and the standard library.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from operator import itemgetter

import numpy as np

State = list[tuple[float, int]]


def classic_is_chunked(d: np.ndarray, k: int) -> bool:
    """Whether classic LDM on the descending costs `d` provably runs exactly like the chunked
    start, so that its result is known without running it.

    Classic LDM takes single items while they spread more than every state made so far. Its
    first k singles thus merge into one state, the first chunk, which goes on the heap; the
    next k form the second chunk if its *last* item still spreads more than the first chunk,
    and so on. If that holds for every chunk, the run built exactly the chunked start (same
    slots, same nodes, tiebreaks in the same order) and goes on exactly like it. The largest
    spread so far only grows and the last items only shrink, so it holds for every chunk if
    it holds for the last one: every spread of the chunks before it is below the smallest
    cost. The one exception is a last chunk of a single item after others: classic LDM leaves
    it a lone single, which loses ties the chunked start's short chunk would win, so it is
    never claimed. On token counts with many ties the check almost always holds: half the work
    saved.
    """
    n = len(d)
    if n % k == 1 and n > 1:
        return False
    before_last = (n - 1) // k * k  # items in the chunks before the last one, all full
    if before_last == 0:
        return True  # a single chunk: both starts are that one state
    smallest = d[n - 1]
    if d[0] - d[k - 1] >= smallest:  # the first chunk alone already fails (cheap, and common)
        return False
    # The very subtraction the differencing does for each chunk's spread.
    return bool((d[0:before_last:k] - d[k - 1:before_last:k]).max() < smallest)


def ldm_labels(desc: list[float], order: list[int], k: int, *, chunked: bool) -> np.ndarray:
    """Run the differencing from the chunked or the classic start; each position's shard.

    `desc` holds the costs sorted descending, ties by position, and `order` their positions.
    Two shards take `_differencing_two`, any other k the general `_differencing`.
    """
    n = len(desc)
    if k == 2:
        final, left, right = _differencing_two(_two_slot_start(desc, order, chunked), n)
    elif chunked:
        final, left, right = _differencing(_chunk_states(desc, order, k), [], [], k, n)
    else:
        final, left, right = _differencing([], desc, order, k, n)
    # Every combined slot became a new node n + j whose two halves are left[j] and right[j].
    # Label each final slot with its shard index, then walk the internal nodes newest first
    # (a node is always created after its halves), handing the label down; leaves 0..n-1 are
    # the input positions. O(n), no recursion.
    label = [0] * (n + len(left))
    for shard, (_, node) in enumerate(final):
        label[node] = shard
    for node, half, other in zip(range(n + len(left) - 1, n - 1, -1), reversed(left),
                                 reversed(right), strict=True):
        label[half] = label[other] = label[node]
    return np.fromiter(label, np.int64, n)  # the first n: the input positions


def _chunk_states(desc: list[float], order: list[int], k: int) -> list[tuple[float, int, State]]:
    """Equal-count starting states: consecutive chunks of k sorted items, one per slot, as a
    heap keyed by (-spread, chunk start). The last chunk may be short (empty slots are 0)."""
    slots = list(zip([-x for x in desc], order, strict=True))  # (-cost, node), heaviest first
    states = []
    for start in range(0, len(desc), k):
        chunk = slots[start:start + k]
        spread = (chunk[-1][0] if len(chunk) == k else 0.0) - chunk[0][0]
        states.append((-spread, start, chunk))
    heapq.heapify(states)
    return states


def _differencing(heap: list[tuple[float, int, State]], singles: list[float],
                  single_nodes: list[int], k: int,
                  n: int) -> tuple[State, list[int], list[int]]:
    """The LDM loop. Returns the final state and the (left, right) halves of every new node.

    Representation, chosen for speed in pure Python: a state lists only its *occupied* slots
    as (-sum, node) tuples sorted ascending, i.e. heaviest first; the k - len(state) empty
    slots are implicit zeros after them. `heap` holds states keyed by (-spread, tiebreak).
    Single-item states are not pushed at all: `singles` (descending costs, node =
    `single_nodes[i]`) is consumed from the front, since its spreads are already sorted.
    """
    pop, push = heapq.heappop, heapq.heappush
    left: list[int] = []
    right: list[int] = []
    i, num_singles = 0, len(singles)  # singles[i] is the next single item to take
    neg_singles = [-x for x in singles]  # ascending, for bisect
    remaining = len(heap) + num_singles
    tiebreak = n  # after the chunk indices used as tiebreaks in equal-count mode

    while remaining > 1:
        remaining -= 1
        # Take the two states with the largest spreads (a before b): each is either a
        # combined state from the heap or the next single item, whichever spreads more.
        if heap and (i >= num_singles or -heap[0][0] >= singles[i]):
            a = pop(heap)[2]
        else:
            a = [(neg_singles[i], single_nodes[i])]
            i += 1
        if heap and (i >= num_singles or -heap[0][0] >= singles[i]):
            b = pop(heap)[2]
        else:
            b = [(neg_singles[i], single_nodes[i])]
            i += 1
        m, p = len(a), len(b)
        if m + p <= k:
            # Every occupied slot of one meets an empty slot of the other: a plain union.
            if p == 1:
                merged = a.copy()
                insort(merged, b[0])
            elif m == 1:
                merged = b.copy()
                insort(merged, a[0])
            else:
                merged = sorted(a + b)
            # Shortcut, same result as looping: a partial state holds only single items, all
            # taken earlier, so all >= the next single. It therefore stays the top state and
            # keeps absorbing the next single (appended: it sorts last) while that single
            # spreads strictly more than the best state in the heap (ties go to the heap, as
            # in the two takes above), or until it is full.
            room = k - len(merged)
            if room and i < num_singles:
                top = -heap[0][0] if heap else -1.0  # costs are >= 0: -1 is below all
                j = bisect_left(neg_singles, -top, i, min(i + room, num_singles))
                merged += zip(neg_singles[i:j], single_nodes[i:j], strict=True)
                remaining -= j - i
                i = j
        elif m + p == k + 1:
            # Exactly one slot pair is occupied on both sides: a's lightest meets b's lightest
            # (the common case late in the run, a full state absorbing one item). A binary
            # insert beats re-sorting k tuples.
            merged = a[:-1] + b[:-1]
            if m > 1 and p > 1:
                merged.sort()  # two sorted runs: timsort merges them in linear time
            insort(merged, (a[-1][0] + b[-1][0], n + len(left)))
            left.append(a[-1][1])
            right.append(b[-1][1])
        else:
            # Dense view: slot t of a (heaviest first) meets slot k-1-t of b. Both are occupied
            # for t in [lo, m); a's heavier slots [0, lo) and b's heavier slots [0, k-m) meet
            # empty slots and are carried over unchanged.
            lo = k - p if k > p else 0
            pa = a[lo:m]
            pb = b[k - m:k - lo][::-1]
            first = n + len(left)
            merged = [(x + y, first + j)
                      for j, ((x, _), (y, _)) in enumerate(zip(pa, pb, strict=True))]
            left.extend([node for _, node in pa])
            right.extend([node for _, node in pb])
            merged += a[:lo]
            merged += b[:k - m]
            merged.sort()
        tiebreak += 1
        spread = (merged[-1][0] if len(merged) == k else 0.0) - merged[0][0]
        push(heap, (-spread, tiebreak, merged))
    final = heap[0][2] if heap else [(-singles[0], single_nodes[0])]
    return final, left, right


# Two shards, the most common data-parallel case, get a loop of their own: several times
# faster than `_differencing`, and the same result to the last bit (tests/test_partition.py
# checks it against `_differencing`). A two-shard state has at most two slots, so it fits in
# one flat tuple instead of a list of slot tuples:
#     (-spread, tiebreak, heavy sum, heavy node, light sum, light node)
# a lone item having light node -1. Sums are kept positive here, negative there; IEEE
# rounding is symmetric, so x + y here is bit for bit -((-x) + (-y)) there, and every other
# decision (which state to take, which slot is heavier) is one of `_differencing`'s tuple
# comparisons written out by hand, down to equal sums going to the lower node id.
TwoSlots = tuple[float, int, float, int, float, int]


def _two_slot_start(desc: list[float], order: list[int], chunked: bool) -> list[TwoSlots]:
    """The starting states for `_differencing_two`, in the order the differencing takes them:
    ascending by (-spread, tiebreak). The tiebreaks reproduce `_differencing`'s: chunks keep
    their start (before every combined state, whose tiebreaks are n+1, n+2, ...), while
    singles, which lose every tie to a combined state there, get 2n + i (after all of them)."""
    n = len(desc)
    if not chunked:  # each item alone: already in order, largest spread (= cost) first
        return list(zip([-x for x in desc], range(2 * n, 3 * n), desc, order,
                        [0.0] * n, [-1] * n, strict=True))
    # Pairs of consecutive sorted items; an odd last item pairs with an empty slot (cost 0).
    heavy, light = desc[0::2], desc[1::2] + [0.0] * (n % 2)
    nodes = order + [-1] * (n % 2)
    keys = [lo - hi for hi, lo in zip(heavy, light, strict=True)]  # -spread, as there
    states = list(zip(keys, range(0, n, 2), heavy, nodes[0::2], light, nodes[1::2],
                      strict=True))
    # A stable sort keeps equal spreads in chunk order, the heap's (-spread, start) order.
    states.sort(key=itemgetter(0))
    return states


def _differencing_two(start: list[TwoSlots], n: int) -> tuple[State, list[int], list[int]]:
    """`_differencing` for k = 2, from `_two_slot_start`'s states; the same result exactly.

    The start states need no heap: they are already in taking order, so they are read from the
    front of `start` (like the singles there), and only combined states go on the heap. Each
    step takes whichever of the two fronts is smaller, (-spread, tiebreak) deciding ties.
    """
    pop, push = heapq.heappop, heapq.heappush
    heap: list[TwoSlots] = []
    left: list[int] = []
    right: list[int] = []
    to_left, to_right = left.append, right.append
    i, size = 0, len(start)
    tiebreak = new = n  # `new`: the id the next new node gets
    for _ in range(size - 1):
        if heap and (i == size or heap[0] < start[i]):
            _, _, ah, a_hn, al, a_ln = pop(heap)
        else:
            _, _, ah, a_hn, al, a_ln = start[i]
            i += 1
        if heap and (i == size or heap[0] < start[i]):
            _, _, bh, b_hn, bl, b_ln = pop(heap)
        else:
            _, _, bh, b_hn, bl, b_ln = start[i]
            i += 1
        if a_ln >= 0 and b_ln >= 0:
            # Heavy meets light twice: new nodes `new` (a's heavy + b's light) and `new + 1`;
            # on equal sums the lower node, `new`, counts as the heavier.
            x, y = ah + bl, al + bh
            to_left(a_hn)
            to_left(a_ln)
            to_right(b_ln)
            to_right(b_hn)
            hs, hn, ls, ln = (x, new, y, new + 1) if x >= y else (y, new + 1, x, new)
            new += 2
        elif a_ln >= 0:  # b is one item: it joins a's light slot; a's heavy slot stays
            z = al + bh
            to_left(a_ln)
            to_right(b_hn)
            hs, hn, ls, ln = (ah, a_hn, z, new) if ah >= z else (z, new, ah, a_hn)
            new += 1
        elif b_ln >= 0:  # a is one item: it joins b's light slot
            z = ah + bl
            to_left(a_hn)
            to_right(b_ln)
            hs, hn, ls, ln = (bh, b_hn, z, new) if bh >= z else (z, new, bh, b_hn)
            new += 1
        elif ah > bh or (ah == bh and a_hn < b_hn):  # two items: side by side, no new node
            hs, hn, ls, ln = ah, a_hn, bh, b_hn
        else:
            hs, hn, ls, ln = bh, b_hn, ah, a_hn
        tiebreak += 1
        push(heap, (ls - hs, tiebreak, hs, hn, ls, ln))
    _, _, hs, hn, ls, ln = heap[0] if heap else start[0]
    return ([(-hs, hn), (-ls, ln)] if ln >= 0 else [(-hs, hn)]), left, right
