"""Any batch over any DP size: a data-parallel update computes the single-rank loss and gradient.

A property test over random batches (1-12 sequences of random lengths), DP sizes (1-4, so
shards and micro-batches are often empty), token budgets and every loss aggregation mode.
Each DP rank runs the worker's own update walk (`actor.train_shard`: the plan's shard, the
token-budget micro-batches with `same_micro_count`, global loss weights, the empty-micro-batch
forward) on its copy of a tiny policy; FSDP's gradient reduction (the mean over ranks) is done
here by hand, since the in-process backend runs one rank per role (FSDP needs one process per
rank; `test_ppo_failures.py` runs empty shards through real FSDP on Ray). The summed loss
metric and the reduced gradient must equal one rank's on the whole batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from avrid.dispatch import Batch, DispatchConfig, make_plan
from avrid.ppo.algo.losses import AGG_MODES, policy_loss
from avrid.ppo.data.columns import ModelInputs, Totals, padded
from avrid.ppo.engines.models import TinyModelSpec, build_tiny_policy
from avrid.ppo.roles.forward import response_logprobs, train_shard
from avrid.results import ResultBuilder
from avrid.workers import WorkerIdentity
from tests.helpers import GradRecorder

pytestmark = pytest.mark.chapter(5)

VOCAB, NORM_LEN = 11, 6
MODEL = build_tiny_policy(TinyModelSpec(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_layers=1, num_heads=2, num_kv_heads=2), seed=0)


def random_batch(draw: st.DrawFn) -> Batch:
    n = draw(st.integers(1, 12))
    prompts = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    responses = draw(st.lists(st.integers(1, NORM_LEN), min_size=n, max_size=n))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    rows = [torch.randint(1, VOCAB, (p + r,), generator=gen)
            for p, r in zip(prompts, responses, strict=True)]
    return Batch.from_rows(
        sample_ids=range(100, 100 + n), prompt_lens=prompts, response_lens=responses,
        packed={"tokens": rows,
                "old_logp": [-torch.rand(r, generator=gen) * 3 for r in responses],
                "advantages": [torch.randn(r, generator=gen) for r in responses]})


def update(batch: Batch, dp: int, budget: int, agg: str) -> tuple[float, dict]:
    """The loss metric summed over ranks and the rank-mean gradient (what FSDP applies)."""
    plan = make_plan(batch, dp, DispatchConfig(micro_batch_tokens=budget, same_micro_count=True))
    totals = Totals.of(batch, NORM_LEN)
    loss, grads = 0.0, {}
    for shard in plan.split(batch):
        model = copy.deepcopy(MODEL)
        recorder = GradRecorder(model)
        builder = ResultBuilder.for_shard(
            WorkerIdentity(role="actor", rank=shard.index, world_size=dp), shard)

        def loss_fn(x: ModelInputs, mb: Batch, w: torch.Tensor, b: ResultBuilder,
                    model: torch.nn.Module = model) -> torch.Tensor:
            logp, _ = response_logprobs(model, x, 1.0)
            out = policy_loss(logp, padded(mb, "old_logp"), padded(mb, "advantages"),
                              x.response_mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
            return (out.per_token * w).sum()

        train_shard(model, recorder, shard, builder, loss_fn, pad_id=0, agg=agg,
                    totals=totals, world_size=dp, grad_clip=1e9, prefix="actor")
        metrics = {m.name: m for m in builder.build().metrics}
        loss += metrics["actor/loss"].value
        for name, g in recorder.grads.items():
            grads[name] = grads.get(name, 0) + g / dp  # FSDP: the mean over ranks
    return loss, grads


@settings(max_examples=40)
@given(data=st.data())
def test_a_dp_update_equals_the_single_rank_update(data: st.DataObject) -> None:
    batch = data.draw(st.composite(lambda draw: random_batch(draw))())
    dp = data.draw(st.integers(1, 4))
    longest = int((batch.prompt_lens + batch.response_lens).max())
    budget = data.draw(st.integers(longest, 3 * longest))
    agg = data.draw(st.sampled_from(AGG_MODES))
    one_loss, one_grads = update(batch, 1, 10**6, agg)
    dp_loss, dp_grads = update(batch, dp, budget, agg)
    assert abs(dp_loss - one_loss) <= 1e-5 * max(1.0, abs(one_loss))
    assert dp_grads.keys() == one_grads.keys()
    for name, g in one_grads.items():
        torch.testing.assert_close(dp_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
