"""Chapter 2 — `cached_plan`: a repeated shape is planned once, and nothing else changes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from avrid.dispatch import Batch, DispatchConfig, FlopCost, FunctionCost, make_plan
from avrid.dispatch.plan_cache import (
    CACHE_SIZE,
    cached_plan,
    clear_plan_cache,
    plan_cache_stats,
)

pytestmark = pytest.mark.chapter(2)


@pytest.fixture(autouse=True)
def empty_cache() -> Iterator[None]:
    clear_plan_cache()
    yield
    clear_plan_cache()


def batch(seed: int, n: int = 40, first_id: int = 0, **columns: torch.Tensor) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(sample_ids=torch.arange(first_id, first_id + n),
                 prompt_lens=torch.randint(1, 9, (n,), generator=g),
                 response_lens=torch.randint(0, 30, (n,), generator=g), scalars=columns)


def test_a_repeat_is_a_hit_and_equals_a_fresh_plan() -> None:
    config = DispatchConfig(micro_batch_tokens=64)
    first = cached_plan(batch(0), 3, config)
    # Another batch object with the same ids and lengths but other columns (the value pass
    # after the log-prob pass): the same plan, found, not made.
    again = cached_plan(batch(0, score=torch.ones(40)), 3, config)
    assert again is first and again == make_plan(batch(0), 3, config)
    assert plan_cache_stats() == {"hits": 1, "misses": 1, "size": 1}


@pytest.mark.parametrize("change", ["lengths", "ids", "shards", "config"])
def test_anything_a_plan_depends_on_makes_a_new_one(change: str) -> None:
    config = DispatchConfig(micro_batch_tokens=64)
    base = cached_plan(batch(0), 3, config)
    b, k, c = batch(0), 3, config
    if change == "lengths":
        b = batch(1)
    elif change == "ids":
        b = batch(0, first_id=1000)
    elif change == "shards":
        k = 4
    else:
        c = DispatchConfig(micro_batch_tokens=64, equal_count=True)
    other = cached_plan(b, k, c)
    assert other is not base and other == make_plan(b, k, c)
    assert plan_cache_stats()["misses"] == 2


def test_a_user_cost_function_is_planned_every_time() -> None:
    calls = []

    def cost(p: float, r: float) -> float:
        calls.append(1)
        return p + r

    config = DispatchConfig(cost=FunctionCost(fn=cost))
    cached_plan(batch(0), 2, config)
    cached_plan(batch(0), 2, config)
    assert len(calls) == 80 and plan_cache_stats()["size"] == 0  # 2 x 40 samples, no cache
    flops = DispatchConfig(cost=FlopCost(linear=1.0, quadratic=0.01))
    assert cached_plan(batch(0), 2, flops) is cached_plan(batch(0), 2, flops)


def test_only_the_most_recent_plans_are_kept() -> None:
    plans = [cached_plan(batch(s), 2) for s in range(CACHE_SIZE + 1)]
    assert plan_cache_stats()["size"] == CACHE_SIZE
    assert cached_plan(batch(CACHE_SIZE), 2) is plans[-1]  # recent: kept
    assert cached_plan(batch(0), 2) is not plans[0]  # the oldest was dropped, made again
    assert cached_plan(batch(0), 2) == plans[0]


def test_a_bad_batch_fails_every_time_and_is_not_remembered() -> None:
    empty = Batch(sample_ids=torch.zeros(0, dtype=torch.int64),
                  prompt_lens=torch.zeros(0, dtype=torch.int64),
                  response_lens=torch.zeros(0, dtype=torch.int64))
    for _ in range(2):
        with pytest.raises(ValueError, match="empty batch"):
            cached_plan(empty, 2)
    assert plan_cache_stats()["size"] == 0
