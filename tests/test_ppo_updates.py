"""Chapter 5 actor and critic updates on one rank, against the losses computed on the whole batch.

Each test builds a real worker (in-process, one rank, fp32: no process group), swaps its AdamW
for a recorder that keeps the gradients the step would have applied, and runs `update` on a
hand-made shard of two micro-batches. The reference is the plain loss of `losses.py` over the
whole batch, so what is pinned is the update's weighting, not a snapshot of its output.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from avrid.dispatch import Batch, Shard
from avrid.ppo.algo.losses import AGG_MODES, aggregate, value_loss
from avrid.ppo.data.columns import Totals, model_inputs, packed, padded
from avrid.ppo.engines.models import build_tiny_critic, tiny_spec
from avrid.ppo.roles.critic import CriticWorker
from avrid.ppo.roles.forward import response_logprobs, response_values
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.roles.trained import lr_at
from avrid.ppo.setup.config import PPOConfig, TrainConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.workers import WorkerIdentity
from tests.helpers import GradRecorder, ragged_batch

pytestmark = pytest.mark.chapter(5)

VOCAB, PAD, EOS = 16, 0, 1
NORM_LEN = 5
PROMPT_LENS, RESPONSE_LENS = [2, 3, 1, 2], [3, 1, 4, 2]


def config(*overrides: str) -> PPOConfig:
    """Tiny fp32 models on one in-process rank; no gradient clipping (clip_grad_norm_ with a
    huge bound multiplies by exactly 1.0)."""
    return with_overrides(PPOConfig(), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "model.hidden_size=32", "model.num_heads=2", "train.grad_clip=1e9", *overrides])


def make_batch(seed: int = 0) -> Batch:
    """Four samples of ragged prompts and responses with every column an update reads."""
    return ragged_batch(PROMPT_LENS, RESPONSE_LENS, vocab=VOCAB, sample_ids=[10, 11, 12, 13],
                        columns={"values": 0.5, "returns": 1.0, "advantages": 1.0}, seed=seed)

def shard_of(batch: Batch) -> Shard:
    """The whole batch as one rank's shard, cut into two micro-batches."""
    half = len(batch) // 2
    return Shard(index=0, batch=batch, micro_bounds=(0, half, len(batch)))


def identity(role: str) -> WorkerIdentity:
    return WorkerIdentity(role=role, rank=0, world_size=1)


def critic_grads(cfg: PPOConfig, batch: Batch) -> dict[str, torch.Tensor]:
    worker = CriticWorker(identity("critic"), config=cfg, vocab_size=VOCAB, pad_id=PAD)
    worker.setup()
    worker.optimizer = GradRecorder(worker.model)
    worker.update(shard_of(batch), totals=Totals.of(batch, NORM_LEN), step=0)
    return worker.optimizer.grads


def actor_grads(cfg: PPOConfig, batch: Batch) -> dict[str, torch.Tensor]:
    worker = PolicyWorker(identity("policy"), config=cfg, vocab_size=VOCAB, eos_id=EOS,
                          pad_id=PAD, max_response_tokens=NORM_LEN)
    worker.setup()
    with torch.no_grad():  # ratio 1 and a reference a little off: every loss term has grad
        x = model_inputs(batch, PAD)
        logp, _ = response_logprobs(worker.model, x, cfg.rollout.temperature)
    mask = x.response_mask.bool()
    columns = {"old_logp": logp, "ref_logp": logp - 0.3}
    batch = Batch(sample_ids=batch.sample_ids, prompt_lens=batch.prompt_lens,
                  response_lens=batch.response_lens, scalars=batch.scalars,
                  packed={**batch.packed, **{k: packed(v, mask) for k, v in columns.items()}})
    worker.optimizer = GradRecorder(worker.model)
    worker.update(shard_of(batch), totals=Totals.of(batch, NORM_LEN), step=0)
    return worker.optimizer.grads


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                      tol: float = 1e-6) -> None:
    assert a.keys() == b.keys() and a
    worst = max(float((a[n] - b[n]).abs().max()) for n in a)
    assert worst < tol, worst


@pytest.mark.parametrize("mode", AGG_MODES)
def test_critic_update_works_in_every_aggregation_mode(mode: str) -> None:
    # The update's gradient must be that of value_loss over the whole batch, aggregated by
    # `mode` (seq-mean-token-sum-norm used to crash: norm_len was not passed).
    cfg = config(f"algo.loss_agg={mode}", "algo.value_clip=0.2")
    batch = make_batch()
    got = critic_grads(cfg, batch)
    ref = build_tiny_critic(tiny_spec(cfg, VOCAB), seed=cfg.train.seed + 1)
    x = model_inputs(batch, PAD)
    out = value_loss(response_values(ref, x), padded(batch, "values"), padded(batch, "returns"),
                     x.response_mask, clip=0.2)
    aggregate(out.per_token, x.response_mask, mode, norm_len=NORM_LEN).backward()
    assert_same_grads(got, {n: p.grad for n, p in ref.named_parameters()})


def with_loss_mask(batch: Batch, keep: list[float]) -> Batch:
    return dataclasses.replace(batch, scalars={**batch.scalars,
                                               "loss_mask": torch.tensor(keep)})


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("role", ["critic", "actor"])
def test_a_masked_sample_trains_like_an_absent_one(role: str, mode: str) -> None:
    # algo.truncation=mask gives truncated samples loss_mask 0: the update must then equal
    # the update on the batch without them (weights AND denominators), in every mode.
    cfg = config(f"algo.loss_agg={mode}", "algo.kl_coef=0.1", "algo.kl_kind=k3",
                 "algo.entropy_coef=0.01")
    grads = critic_grads if role == "critic" else actor_grads
    batch = make_batch()
    masked = grads(cfg, with_loss_mask(batch, [1.0, 0.0, 1.0, 1.0]))
    absent = grads(cfg, batch.take(torch.tensor([0, 2, 3])))
    assert_same_grads(masked, absent)
    everything = grads(cfg, batch)  # not vacuous: sample 1 does change the gradient
    assert max(float((masked[n] - everything[n]).abs().max()) for n in masked) > 1e-4


def test_totals_leave_masked_samples_out() -> None:
    batch = with_loss_mask(make_batch(), [1.0, 0.0, 1.0, 0.0])
    assert Totals.of(batch, NORM_LEN) == Totals(tokens=3 + 4, seqs=2, norm_len=NORM_LEN)
    assert Totals.of(make_batch(), NORM_LEN) == Totals(tokens=10, seqs=4, norm_len=NORM_LEN)



# ---- the learning-rate schedule ----------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_learning_rate_warms_up_then_follows_the_schedule(schedule: str) -> None:
    t = TrainConfig(steps=10, lr_warmup_steps=4, lr_schedule=schedule, min_lr_ratio=0.1)
    lrs = [lr_at(t, 2.0, k) for k in range(10)]
    assert lrs[:4] == [0.5, 1.0, 1.5, 2.0]  # (k + 1) / 4 of the rate
    assert lrs[4] == 2.0  # the schedule starts at the full rate
    if schedule == "constant":
        assert lrs[4:] == [2.0] * 6
    else:  # decays to min_lr_ratio x lr at the last step, never rising on the way
        assert lrs[-1] == pytest.approx(0.2)
        assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))
    if schedule == "cosine":  # half-way through the decay: the mean of the ends
        assert lr_at(TrainConfig(steps=5, lr_schedule="cosine"), 1.0, 2) == pytest.approx(0.5)


def test_the_defaults_keep_the_rate_exactly() -> None:
    assert all(lr_at(TrainConfig(), 1e-3, k) == 1e-3 for k in range(200))


def test_an_update_trains_at_its_steps_rate_and_logs_it() -> None:
    cfg = config("train.steps=6", "train.lr_warmup_steps=3", "train.critic_lr=0.03")
    worker = CriticWorker(identity("critic"), config=cfg, vocab_size=VOCAB, pad_id=PAD)
    worker.setup()
    batch = make_batch()
    for step, want in [(0, 0.01), (1, 0.02), (4, 0.03)]:
        result = worker.update(shard_of(batch), totals=Totals.of(batch, NORM_LEN), step=step)
        assert worker.optimizer.param_groups[0]["lr"] == pytest.approx(want)
        assert {m.name: m.value for m in result.metrics}["critic/lr"] == pytest.approx(want)
