"""Balanced partitioning: properties every partitioner keeps, the guarantees that are proved,
the quality Karmarkar–Karp reaches on long-tailed lengths, the errors for bad input, and its
fast paths (differencing.py) returning exactly what the general machinery does."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from avrid.dispatch.differencing import (
    _chunk_states,
    _differencing,
    _differencing_two,
    _two_slot_start,
    classic_is_chunked,
)
from avrid.dispatch.partition import (
    METHODS,
    Partition,
    _build,
    contiguous,
    greedy_lpt,
    karmarkar_karp,
    partition,
)
from avrid.dispatch.refine import refine

pytestmark = pytest.mark.chapter(2)

PARTITIONERS: dict[str, Callable[..., Partition]] = {
    "kk": karmarkar_karp, "lpt": greedy_lpt, "contiguous": contiguous}

# Integers (ties, zeros) and floats over a wide range, as token and FLOP costs produce.
cost = st.one_of(st.integers(0, 50).map(float),
                 st.floats(0, 1e9, allow_nan=False, allow_infinity=False))
costs_lists = st.lists(cost, min_size=1, max_size=120)
ks = st.integers(1, 20)
methods = st.sampled_from(METHODS)


def _bound_slack(c: list[float]) -> float:
    """Room for float rounding when comparing sums of up to 120 values of up to 1e9."""
    return 1e-9 * max(1.0, sum(c))


@given(costs_lists, ks, methods, st.booleans())
def test_every_position_lands_in_exactly_one_shard(c: list[float], k: int, method: str,
                                                   equal_count: bool) -> None:
    p = partition(c, k, method, equal_count=equal_count)
    assert p.num_shards == k and len(p.costs) == k
    assert sorted(i for shard in p.shards for i in shard) == list(range(len(c)))
    for shard in p.shards:
        assert list(shard) == sorted(shard)  # ascending positions inside each shard
    assert sum(p.sizes) == len(c)


@given(costs_lists, ks, methods, st.booleans())
def test_costs_bound_and_imbalance_are_consistent(c: list[float], k: int, method: str,
                                                  equal_count: bool) -> None:
    p = partition(c, k, method, equal_count=equal_count)
    for shard, shard_cost in zip(p.shards, p.costs, strict=True):
        assert shard_cost == pytest.approx(math.fsum(c[i] for i in shard), rel=1e-9, abs=1e-9)
    assert p.lower_bound == pytest.approx(max(math.fsum(c) / k, max(c)), rel=1e-12)
    assert p.max_cost == max(p.costs)
    assert p.imbalance >= 1 - 1e-9
    if p.lower_bound > 0:
        assert p.imbalance == p.max_cost / p.lower_bound
    else:
        assert p.imbalance == 1.0


@given(costs_lists, ks, st.sampled_from(["kk", "lpt"]))
def test_equal_count_sizes_differ_by_at_most_one(c: list[float], k: int, method: str) -> None:
    p = partition(c, k, method, equal_count=True)
    q, r = divmod(len(c), k)
    assert sorted(p.sizes) == [q] * (k - r) + [q + 1] * r
    assert p.equal_count


@given(costs_lists, ks)
def test_contiguous_is_array_split_by_count(c: list[float], k: int) -> None:
    p = contiguous(c, k)
    expected = [tuple(a.tolist()) for a in np.array_split(np.arange(len(c)), k)]
    assert list(p.shards) == expected
    assert contiguous(c, k, equal_count=True) == p


@given(costs_lists, ks, methods, st.booleans())
def test_same_input_same_output(c: list[float], k: int, method: str, equal_count: bool) -> None:
    first = partition(c, k, method, equal_count=equal_count)
    assert partition(list(c), k, method, equal_count=equal_count) == first
    assert partition(np.array(c), np.int64(k), method, equal_count=equal_count) == first


@given(costs_lists, ks, st.booleans())
def test_kk_max_is_within_one_largest_cost_of_the_mean(c: list[float], k: int,
                                                       equal_count: bool) -> None:
    # Proved in karmarkar_karp's docstring: a combine never widens the spread, so the final
    # max - min <= largest cost, and max <= total/k + (1 - 1/k) * largest.
    p = karmarkar_karp(c, k, equal_count=equal_count)
    assert max(p.costs) - min(p.costs) <= max(c) + _bound_slack(c)
    assert p.max_cost <= math.fsum(c) / k + (1 - 1 / k) * max(c) + _bound_slack(c)


@given(costs_lists, ks)
def test_lpt_max_is_within_one_largest_cost_of_the_mean(c: list[float], k: int) -> None:
    # List scheduling: the last item put on the heaviest shard found it lightest.
    p = greedy_lpt(c, k)
    assert p.max_cost <= math.fsum(c) / k + (1 - 1 / k) * max(c) + _bound_slack(c)


@given(costs_lists, ks, methods)
def test_equal_count_max_is_at_most_the_largest_ceil_n_over_k(c: list[float], k: int,
                                                              method: str) -> None:
    p = partition(c, k, method, equal_count=True)
    most = math.ceil(len(c) / k)
    assert p.max_cost <= math.fsum(sorted(c, reverse=True)[:most]) + _bound_slack(c)


@given(st.lists(cost, min_size=1, max_size=20), st.integers(20, 40), st.booleans())
def test_fewer_items_than_shards_leaves_empty_shards(c: list[float], k: int,
                                                     equal_count: bool) -> None:
    for method in ("kk", "lpt"):
        p = partition(c, k, method, equal_count=equal_count)
        # Each item alone: the best possible, exactly the largest cost.
        assert max(p.sizes) == 1 and p.max_cost == max(c) == p.lower_bound
        empty = [s for s, shard in enumerate(p.shards) if not shard]
        assert len(empty) == k - len(c)
        assert all(p.costs[s] == 0.0 for s in empty)
    p = contiguous(c, k)
    assert p.sizes == (1,) * len(c) + (0,) * (k - len(c))


def test_single_item_and_single_shard() -> None:
    for method in METHODS:
        one = partition([5.0], 3, method)
        assert sorted(one.sizes) == [0, 0, 1] and one.max_cost == 5.0 and one.imbalance == 1.0
        whole = partition([3.0, 1.0, 2.0], 1, method)
        assert whole.shards == ((0, 1, 2),) and whole.costs == (6.0,) and whole.imbalance == 1.0


def test_all_zero_costs_still_spread_by_count() -> None:
    # LPT prefers the shard with fewer samples on a tie; KK's chunked start wins cost ties.
    for method in METHODS:
        p = partition([0.0] * 10, 4, method)
        assert p.imbalance == 1.0 and p.lower_bound == 0.0 and p.costs == (0.0,) * 4
        assert max(p.sizes) - min(p.sizes) <= 1


@given(costs_lists, ks)
def test_kk_without_the_count_constraint_is_never_worse_than_with_it(c: list[float],
                                                                     k: int) -> None:
    # Unconstrained KK keeps the better of its two starts, one of which is the chunked one.
    assert karmarkar_karp(c, k).max_cost <= karmarkar_karp(c, k, equal_count=True).max_cost


def test_kk_keeps_huge_items_alone_where_equal_counts_cannot() -> None:
    c = [100.0] + [1.0] * 7
    assert karmarkar_karp(c, 2).costs == (100.0, 7.0)  # the classic start wins here
    assert karmarkar_karp(c, 2, equal_count=True).max_cost == 103.0


def test_known_small_case_and_describe() -> None:
    # LDM alone gives 7+5+4 | 8+6 = 16 | 14; one exchange (7 for 6) reaches the optimum.
    p = karmarkar_karp([8, 7, 6, 5, 4], 2)
    assert p.shards == ((2, 3, 4), (0, 1)) and p.costs == (15.0, 15.0)
    assert p.lower_bound == 15.0 and p.imbalance == 1.0
    text = p.describe()
    assert text.splitlines()[0].startswith("kk: 5 samples over 2 shards")
    assert len(text.splitlines()) == 2 + 2  # header, column titles, one line per shard
    assert "equal count" in greedy_lpt([1, 2, 3], 2, equal_count=True).describe()


def _rollout_tokens(n: int, seed: int) -> np.ndarray:
    """Long-tailed RL rollout lengths: modest prompts, lognormal responses, 8% truncated."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(np.log(200), 0.5, n), 16, 2048).astype(np.int64)
    response = np.clip(rng.lognormal(np.log(1500), 1.0, n), 1, 8192).astype(np.int64)
    response[rng.random(n) < 0.08] = 8192
    return (prompt + response).astype(np.float64)


@pytest.mark.parametrize("k", [8, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kk_is_near_the_bound_on_long_tailed_lengths(k: int, seed: int) -> None:
    tokens = _rollout_tokens(1024, seed)
    p = karmarkar_karp(tokens, k)
    assert p.imbalance <= 1.002, p.describe()
    assert p.imbalance <= contiguous(tokens, k).imbalance


@pytest.mark.parametrize(("bad", "match"), [
    ([1.0, float("nan"), 2.0], r"position 1 is nan; costs must be finite"),
    ([1.0, 2.0, float("inf")], r"position 2 is inf; costs must be finite"),
    ([1.0, -3.0], r"position 1 is -3.0; costs must be >= 0"),
    ([], r"an empty batch cannot be partitioned"),
    ([[1.0, 2.0]], r"costs must be 1-D"),
    (["a", "b"], r"costs must be numbers"),
])
@pytest.mark.parametrize("method", METHODS)
def test_bad_costs_raise_naming_the_problem(bad: list, match: str, method: str) -> None:
    with pytest.raises(ValueError, match=match):
        partition(bad, 2, method)


@pytest.mark.parametrize("k", [0, -1, 2.0, 2.5, True, "2", None])
@pytest.mark.parametrize("method", METHODS)
def test_bad_k_raises(k: object, method: str) -> None:
    with pytest.raises(ValueError, match=r"k \(the number of shards\) must be an integer >= 1"):
        PARTITIONERS[method]([1.0, 2.0], k)


def test_unknown_method_lists_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown partition method 'greedy'.*'kk', 'lpt'"):
        partition([1.0], 1, "greedy")  # type: ignore[arg-type]


def test_partition_value_checks_its_own_shape() -> None:
    with pytest.raises(ValueError, match="one cost per shard"):
        Partition(method="kk", equal_count=False, shards=((0,), ()), costs=(1.0,),
                  lower_bound=1.0)


@pytest.mark.parametrize("method", ["kk", "lpt", "contiguous"])
@pytest.mark.parametrize("equal_count", [False, True])
def test_one_shard_holds_every_position_in_order(method: str, equal_count: bool) -> None:
    costs = [5.0, 1.0, 9.0, 0.0, 3.0]
    p = partition(costs, 1, method, equal_count=equal_count)
    assert p.shards == ((0, 1, 2, 3, 4),)
    assert p.costs == (18.0,) and p.lower_bound == 18.0


# --- Fast paths: same result as the general machinery, bit for bit -----------------------
# Heavy ties (token counts), decimals whose float sums depend on the order of the additions,
# zeros, and huge values beside small ones: where a fast path that decided one tie or added
# one pair differently would show.
tied_cost = st.one_of(st.integers(0, 8).map(float),
                      st.sampled_from([0.0, 0.1, 0.2, 0.3, 0.7, 1e16, 2e16 + 2]))
tied_lists = st.lists(tied_cost, min_size=1, max_size=200) | costs_lists


def _descending(c: list[float]) -> tuple[list[float], list[int]]:
    """The sorted costs and their positions, as `karmarkar_karp` feeds the differencing."""
    arr = np.asarray(c, dtype=np.float64)
    order = np.argsort(-arr, kind="stable")
    return arr[order].tolist(), order.tolist()


def _general(desc: list[float], order: list[int], k: int, chunked: bool) -> tuple:
    """`_differencing` from the chunked or the classic start: the reference for fast paths."""
    if chunked:
        return _differencing(_chunk_states(desc, order, k), [], [], k, len(desc))
    return _differencing([], desc, order, k, len(desc))


def _exact(run: tuple) -> tuple:
    """A differencing result with its sums as hex, so equal means equal to the last bit."""
    final, left, right = run
    return [(s.hex(), node) for s, node in final], left, right


@settings(max_examples=300)
@given(tied_lists, st.booleans())
def test_two_shard_loop_is_the_general_differencing(c: list[float], chunked: bool) -> None:
    desc, order = _descending(c)
    fast = _differencing_two(_two_slot_start(desc, order, chunked), len(c))
    assert _exact(fast) == _exact(_general(desc, order, 2, chunked))


@settings(max_examples=300)
@given(tied_lists, st.integers(2, 9))
def test_classic_run_is_skipped_only_where_it_repeats_the_chunked_one(c: list[float],
                                                                      k: int) -> None:
    desc, order = _descending(c)
    if classic_is_chunked(np.asarray(desc), k):
        assert _exact(_general(desc, order, k, False)) == _exact(_general(desc, order, k, True))


def test_classic_run_is_skipped_on_tied_token_counts_not_on_long_tails() -> None:
    rng = np.random.default_rng(0)
    tokens = (rng.integers(5, 9, 256) + rng.integers(1, 7, 256)).astype(np.float64)
    assert classic_is_chunked(np.sort(tokens)[::-1], 2)
    assert not classic_is_chunked(np.sort(_rollout_tokens(256, 0))[::-1], 2)


def _reference_kk(c: list[float], k: int, equal_count: bool) -> Partition:
    """Karmarkar–Karp through the general machinery only: both starts always run."""
    desc, order = _descending(c)
    n, costs = len(c), np.asarray(c, dtype=np.float64)

    def labels(chunked: bool) -> np.ndarray:
        final, left, right = _general(desc, order, k, chunked)
        label = [0] * (n + len(left))
        for shard, (_, node) in enumerate(final):
            label[node] = shard
        for j in reversed(range(len(left))):
            label[left[j]] = label[right[j]] = label[n + j]
        return np.asarray(label[:n], dtype=np.int64)

    best = labels(True)
    if not equal_count:
        classic = labels(False)
        if (np.bincount(classic, weights=costs, minlength=k).max()
                < np.bincount(best, weights=costs, minlength=k).max()):
            best = classic
    return _build("kk", costs, refine(costs, best, k, allow_moves=not equal_count), k,
                  equal_count)


@settings(max_examples=300)
@given(tied_lists, st.integers(2, 9), st.booleans())
def test_kk_with_its_fast_paths_is_the_general_kk(c: list[float], k: int,
                                                  equal_count: bool) -> None:
    fast = karmarkar_karp(c, k, equal_count=equal_count)
    reference = _reference_kk(c, k, equal_count)
    assert fast == reference
    assert [x.hex() for x in fast.costs] == [x.hex() for x in reference.costs]
