"""Exchange refinement (`avrid/dispatch/refine.py`): never worse, counts kept, no moves for
nothing, and the cases where LDM alone stops above what one swap reaches."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from avrid.dispatch.partition import karmarkar_karp
from avrid.dispatch.refine import refine

pytestmark = pytest.mark.chapter(2)

# The module, not the function `avrid.dispatch.partition` that the package exports.
partition_module = importlib.import_module("avrid.dispatch.partition")

costs_and_labels = st.integers(2, 6).flatmap(lambda k: st.tuples(
    st.just(k),
    st.lists(st.tuples(st.floats(0, 1e4, allow_nan=False), st.integers(0, k - 1)),
             min_size=1, max_size=40)))


def _max(c: np.ndarray, labels: np.ndarray, k: int) -> float:
    return float(np.bincount(labels, weights=c, minlength=k).max())


@settings(max_examples=300)
@given(costs_and_labels, st.booleans())
def test_refine_never_raises_the_heaviest_shard_and_keeps_counts_without_moves(
        case: tuple[int, list[tuple[float, int]]], allow_moves: bool) -> None:
    k, pairs = case
    c = np.array([x for x, _ in pairs], dtype=np.float64)
    labels = np.array([s for _, s in pairs], dtype=np.int64)
    out = refine(c, labels, k, allow_moves=allow_moves)
    assert _max(c, out, k) <= _max(c, labels, k)
    assert out.shape == labels.shape and set(out.tolist()) <= set(range(k))
    if not allow_moves:  # swaps only: every shard keeps its count
        assert np.bincount(out, minlength=k).tolist() == np.bincount(labels, minlength=k).tolist()
    if _max(c, out, k) == _max(c, labels, k):  # nothing gained: nothing moved
        assert out is labels


def test_one_swap_reaches_the_optimum_ldm_misses() -> None:
    c = np.array([8.0, 7.0, 6.0, 5.0, 4.0])
    ldm = np.array([1, 0, 1, 0, 0])  # 7+5+4 | 8+6 = 16 | 14
    out = refine(c, ldm, 2, allow_moves=False)
    assert np.bincount(out, weights=c).tolist() == [15.0, 15.0]
    assert np.bincount(out).tolist() == [3, 2]  # the counts LDM gave


def test_a_move_is_made_only_where_counts_may_change() -> None:
    c = np.array([5.0, 4.0, 1.0, 10.0])
    labels = np.array([0, 0, 0, 1])  # 10 | 10: balanced already
    assert refine(c, labels, 2, allow_moves=True) is labels
    uneven = np.array([0, 0, 0, 0, 1])  # 5+4+1+2 | 10 = 12 | 10: moving the 1 gives 11 | 11
    c2 = np.array([5.0, 4.0, 1.0, 2.0, 10.0])
    moved = refine(c2, uneven, 2, allow_moves=True)
    assert np.bincount(moved, weights=c2).max() == 11.0
    # With counts fixed (4 | 1), only a swap with the 10 could help, and it would not.
    assert refine(c2, uneven, 2, allow_moves=False) is uneven


def test_max_rounds_bounds_the_work() -> None:
    c = np.arange(1.0, 41.0)
    labels = np.zeros(40, dtype=np.int64)
    labels[:4] = 1  # one light shard: many exchanges to even out
    one = refine(c, labels, 2, allow_moves=True, max_rounds=1)
    assert int((one != labels).sum()) == 1  # one move, one position changed
    assert _max(c, refine(c, labels, 2, allow_moves=True), 2) < _max(c, one, 2)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("equal_count", [False, True])
def test_kk_with_refinement_is_never_worse_than_ldm_alone(seed: int, equal_count: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(16, 400)), int(rng.choice([2, 3, 8, 16]))
    c = np.clip(rng.lognormal(np.log(1500), 1.0, n), 1, 8192).round()
    refined = karmarkar_karp(c, k, equal_count=equal_count)
    monkeypatch.setattr(partition_module, "refine", lambda c, labels, k, **_: labels)
    alone = karmarkar_karp(c, k, equal_count=equal_count)
    assert refined.max_cost <= alone.max_cost
    assert refined.sizes == alone.sizes or not equal_count  # swaps keep LDM's counts
    assert refined.max_cost >= refined.lower_bound
