"""The dispatch plan (pure): every sample lands exactly once, split/restore round-trips, the
budget and equal counts hold, and there is no divisibility rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from avrid.dispatch import (
    Batch,
    DispatchConfig,
    FunctionCost,
    make_plan,
    micro_batches,
    partition,
)
from avrid.dispatch.microbatch import _spread
from tests.test_batch import make_batch

pytestmark = pytest.mark.chapter(2)

lengths = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 60)), min_size=1, max_size=60)
configs = st.builds(
    DispatchConfig, method=st.sampled_from(["kk", "lpt", "contiguous"]),
    equal_count=st.booleans(), micro_batch_tokens=st.one_of(st.none(), st.integers(20, 200)),
    same_micro_count=st.booleans())


@given(lengths, st.integers(1, 12), configs)
def test_every_sample_lands_in_exactly_one_shard_and_micro_batch(
        ls: list, k: int, config: DispatchConfig) -> None:
    batch = make_batch(ls)
    plan = make_plan(batch, k, config)
    assert sorted(plan.order) == list(range(len(batch)))
    assert plan.num_shards == k and len(plan.micro_bounds) == k
    seen = set()
    for s in range(k):
        size = plan.shard_bounds[s + 1] - plan.shard_bounds[s]
        assert plan.micro_bounds[s][0] == 0 and plan.micro_bounds[s][-1] == size
        for p in plan.shard_positions(s):
            shard, micro = plan.locate(plan.sample_ids[p])
            assert shard == s
            seen.add((p, shard, micro))
    assert len(seen) == len(batch)
    sizes = np.diff(plan.shard_bounds)
    if config.equal_count:
        assert sizes.max() - sizes.min() <= 1
    if config.micro_batch_tokens is not None:
        tokens = batch.total_lens.numpy()
        for shard in plan.split(batch):
            for mb in shard.micro_batches():
                t = int(mb.total_lens.sum())
                # a micro-batch over the budget must be a single oversize sequence
                assert t <= config.micro_batch_tokens or len(mb) == 1
        if config.same_micro_count:
            assert len({len(b) for b in plan.micro_bounds}) == 1
        assert tokens.sum() == sum(int(s.batch.total_lens.sum()) for s in plan.split(batch))


@given(lengths, st.integers(1, 12), configs)
def test_restore_of_split_is_the_identity(ls: list, k: int, config: DispatchConfig) -> None:
    batch = make_batch(ls)
    plan = make_plan(batch, k, config)
    shards = plan.split(batch)
    assert [s.index for s in shards] == list(range(k))
    assert plan.restore([s.batch for s in shards]).equals(batch)
    # micro-batches, concatenated, are the shard itself
    for s in shards:
        assert Batch.concat(s.micro_batches()).equals(s.batch)


@pytest.mark.parametrize(("n", "k"), [(10, 4), (3, 8), (7, 7), (1, 5), (100, 64)])
def test_no_divisibility_constraint(n: int, k: int) -> None:
    batch = make_batch([(1 + i % 5, i % 11) for i in range(n)])
    plan = make_plan(batch, k, DispatchConfig(micro_batch_tokens=16, same_micro_count=True))
    sizes = np.diff(plan.shard_bounds)
    assert sizes.sum() == n and (n >= k or (sizes == 0).sum() == k - n)
    assert plan.restore([s.batch for s in plan.split(batch)]).equals(batch)


def test_plans_are_deterministic_values_that_print() -> None:
    batch = make_batch([(3, 40), (2, 5), (4, 90), (1, 1), (5, 33)])
    a = make_plan(batch, 2, DispatchConfig(micro_batch_tokens=64))
    b = make_plan(batch, 2, DispatchConfig(micro_batch_tokens=64))
    assert a == b and hash(a) == hash(b)
    text = a.describe()
    assert "5 samples over 2 shards" in text and "shard   1" in text


def test_restore_names_the_shard_that_returned_the_wrong_samples() -> None:
    batch = make_batch([(1, 1)] * 6)
    plan = make_plan(batch, 2)
    parts = [s.batch for s in plan.split(batch)]
    with pytest.raises(ValueError, match="shard 1 returned sample ids"):
        plan.restore([parts[0], parts[1].take([0])])
    with pytest.raises(ValueError, match="one batch per shard"):
        plan.restore(parts[:1])
    with pytest.raises(ValueError, match="made for another batch"):
        plan.split(make_batch([(1, 1)] * 6, first_id=100))


@pytest.mark.parametrize(("call", "match"), [
    (lambda: make_plan(make_batch([(1, 1)]).take([]), 2), "an empty batch"),
    (lambda: make_plan(make_batch([(1, 1)]), 0),
     r"k \(the number of shards\) must be an integer >= 1, got 0"),
    (lambda: make_plan(make_batch([(1, 1), (2, 2)], first_id=40), 2, DispatchConfig(
        cost=FunctionCost(fn=lambda p, r: float("nan") if p == 2 else 1.0))),
     r"sample id 41 \(position 1\) is nan"),
    (lambda: make_plan(make_batch([(1, 1), (2, 2)], first_id=40), 2, DispatchConfig(
        cost=FunctionCost(fn=lambda p, r: -p))), r"sample id 40 \(position 0\) is -1.0"),
    (lambda: DispatchConfig(method="round-robin"), "method must be one of"),
    (lambda: DispatchConfig(micro_batch_tokens=0), "micro_batch_tokens must be >= 1"),
    (lambda: make_plan(make_batch([(5, 20), (1, 1)]), 1,
                       DispatchConfig(micro_batch_tokens=10, oversize="error")),
     "position 0 has 25 tokens, over the micro-batch budget of 10"),
    (lambda: micro_batches([3, 3, 3], 4, num_micro=2), "cannot hold"),
    (lambda: micro_batches([1], 0), "budget must be >= 1"),
])
def test_bad_input_fails_with_a_clear_error(call, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        call()


def test_micro_batches_are_the_fewest_that_fit_and_are_balanced() -> None:
    groups = micro_batches([5, 3, 8, 1, 9, 2], 10)
    assert len(groups) == 3  # 28 tokens need at least 3 micro-batches of 10
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert micro_batches([15, 3, 8], 10) == [[0], [1], [2]]  # the oversize one alone
    assert micro_batches([], 10, num_micro=2) == [[], []]


@given(lengths, st.integers(1, 12), configs)
def test_plan_is_the_partition_cut_shard_by_shard(ls: list, k: int,
                                                  config: DispatchConfig) -> None:
    # make_plan gathers every shard's tokens at once and skips the loop for one micro-batch;
    # built here the plain way (each shard alone, every micro-batch looped), it must agree.
    batch = make_batch(ls)
    plan = make_plan(batch, k, config)
    prompt, response = batch.prompt_lens.numpy(), batch.response_lens.numpy()
    part = partition(config.cost(prompt, response), k, config.method,
                     equal_count=config.equal_count)
    tokens = prompt + response
    budget = config.micro_batch_tokens
    cut = [[list(range(len(s)))] if budget is None else micro_batches(tokens[list(s)], budget)
           for s in part.shards]
    if budget is not None and config.same_micro_count:
        most = max(len(g) for g in cut)
        cut = [g if len(g) == most else micro_batches(tokens[list(s)], budget, num_micro=most)
               for g, s in zip(cut, part.shards, strict=True)]
    order: list[int] = []
    for s, groups in enumerate(cut):
        for group in groups:
            order.extend(part.shards[s][i] for i in group)
        bounds = np.cumsum([0] + [len(g) for g in groups]).tolist()
        assert plan.micro_bounds[s] == tuple(bounds)
    assert plan.order == tuple(order) and plan.shard_costs == part.costs


@given(st.lists(st.integers(0, 50), max_size=40), st.integers(0, 60), st.sampled_from([None, 1]))
def test_a_shard_within_the_budget_is_one_micro_batch_as_the_spread_makes_it(
        lens: list[int], slack: int, num_micro: int | None) -> None:
    # micro_batches answers this case without sorting; the longest-first spread agrees.
    budget = max(1, sum(lens) + slack)
    longest_first = sorted(range(len(lens)), key=lambda i: -lens[i])  # stable, as there
    expected = _spread(lens, longest_first, [], budget, 1)
    assert micro_batches(lens, budget, num_micro=num_micro) == expected == [list(range(len(lens)))]
