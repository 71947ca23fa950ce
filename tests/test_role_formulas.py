"""Chapter 5 — the formulas applied inside the roles, checked where they train.

`test_ppo_math.py` pins each formula as a pure function; this file pins that the roles apply
them, and apply them right: the real `PolicyWorker.update` and `.compute_logprobs`,
`CriticWorker.update` and `trainer.compute_advantages` run on a hand-made batch, and the loss
they report, the gradient they would step with, the log-probs and advantages they write must
equal the objective written out again here, token by token, with nothing from avrid in
between (no `policy_loss`, no `model_inputs`, no `token_weights`: the model is called row by
row on its own sequence).

The batch is designed so that every branch is taken: tokens clipped above and below,
tokens the dual clip caps, tokens inside the range; a KL and an entropy term big enough to
move the gradient beyond the tolerance. So deleting or neutralising any line that applies a
term (the KL in the loss, the entropy bonus, the aggregation weights, the clip bounds, the
temperature, the value clip, the gradient clip, GAE's gamma and lambda, whitening, the
truncation penalty, the KL in the reward) fails a test here; `benchmarks/mutants.py` checks
that it does. Chapter 6's importance weights are pinned the same way in
`test_off_policy_update.py`, which reuses these helpers.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from avrid.dispatch import Batch, Shard
from avrid.ppo.algo.losses import AGG_MODES
from avrid.ppo.data.columns import Totals
from avrid.ppo.driver.trainer import compute_advantages
from avrid.ppo.roles.critic import CriticWorker
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.overrides import with_overrides
from avrid.results import merge_metrics
from avrid.workers import WorkerIdentity
from tests.helpers import GradRecorder

pytestmark = pytest.mark.chapter(5)

VOCAB, PAD, EOS = 16, 0, 1
NORM_LEN = 5
PROMPT_LENS, RESPONSE_LENS = [2, 3, 1, 2], [3, 1, 4, 2]  # 10 response tokens
# Per response token, in row order. RATIO = pi_theta / pi_old at the current weights
# (old_logp = logp - log RATIO). With clip_low 0.2, clip_high 0.28, dual_clip 3:
#   4.0 / 3.5 with A < 0: capped by the dual clip;  1.25 and 0.75: inside the asymmetric
#   range, outside a swapped one;  1.6 with A > 0: clipped above;  0.5 with A > 0 and 2.0
#   with A < 0: the unclipped term is the pessimistic one.
RATIO = [4.0, 1.25, 0.75, 1.1, 0.5, 1.6, 0.9, 0.78, 2.0, 3.5]
ADV = [-1.0, 0.8, -0.6, 0.5, 1.2, 0.9, 0.3, 0.7, -1.1, -0.4]
# d = logp - ref_logp, for the KL in the loss.
KL_D = [0.3, -0.2, 0.5, -0.4, 0.1, 0.6, -0.3, 0.2, -0.5, 0.4]
# rho = pi_old / pi_rollout (chapter 6's weight); with is_cap 2, tokens 2, 4 and 7 exceed it.
RHO = [0.5, 1.5, 3.0, 1.8, 2.5, 1.0, 0.7, 4.0, 1.2, 0.9]
TOL = 1e-6


def config(*overrides: str) -> PPOConfig:
    """Tiny fp32 models on one in-process rank; temperature 0.7 (it divides the logits)."""
    return with_overrides(PPOConfig(), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "model.hidden_size=32", "model.num_heads=2", "train.grad_clip=1e9",
        "rollout.temperature=0.7", *overrides])


def rows(flat: list[float]) -> list[torch.Tensor]:
    """Per-token values in row order -> one tensor per response."""
    out, at = [], 0
    for n in RESPONSE_LENS:
        out.append(torch.tensor(flat[at:at + n]))
        at += n
    return out


def token_batch(seed: int = 0, **packed: list[torch.Tensor]) -> Batch:
    """Four samples of ragged prompts and responses, with the given per-token columns."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(2, VOCAB, (p + r,), generator=g)
              for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=True)]
    return Batch.from_rows(sample_ids=[10, 11, 12, 13], prompt_lens=PROMPT_LENS,
                           response_lens=RESPONSE_LENS, packed={"tokens": tokens, **packed})


def each_row(model: torch.nn.Module, batch: Batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits at the positions that predict each response token, those tokens) per row:
    the model runs on one unpadded sequence at a time; position P + j - 1 predicts token
    P + j of a row with a prompt of P tokens."""
    out = []
    for i in range(len(batch)):
        seq = batch.packed["tokens"].row(i).long()
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        logits = model(input_ids=seq[None]).logits[0]
        out.append((logits[p - 1:p + r - 1].float(), seq[p:p + r]))
    return out


def reference_logprobs(model: torch.nn.Module, batch: Batch,
                       temperature: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(log pi(token), entropy) per response token, per row, at `temperature`."""
    out = []
    for logits, tokens in each_row(model, batch):
        logp_all = torch.log_softmax(logits / temperature, dim=-1)
        out.append((logp_all.gather(1, tokens[:, None])[:, 0],
                    -(logp_all.exp() * logp_all).sum(-1)))
    return out


def agg_weight(mode: str, n_i: int, tokens: int, seqs: int) -> float:
    """The weight of one token of a row of n_i tokens in the batch's loss."""
    return {"token-mean": 1 / tokens, "seq-mean-token-sum": 1 / seqs,
            "seq-mean-token-mean": 1 / (n_i * seqs),
            "seq-mean-token-sum-norm": 1 / (NORM_LEN * seqs)}[mode]


def is_weight(correction: str, rho: float, cap: float) -> float:
    """Chapter 6's weight of a token whose pi_old / pi_rollout is rho."""
    if correction == "none":
        return 1.0
    if correction == "tis":
        return min(rho, cap)
    return rho if rho <= cap else 0.0  # decoupled: a token above the cap is dropped


def actor_batch(model: torch.nn.Module, cfg: PPOConfig) -> Batch:
    """`token_batch` with old_logp, advantages, ref_logp and rollout_logp set from the
    model's own log-probs so that the tables above hold exactly."""
    with torch.no_grad():
        logp = torch.cat([lp for lp, _ in reference_logprobs(model, token_batch(),
                                                             cfg.rollout.temperature)])
    old = logp - torch.tensor(RATIO).log()
    return token_batch(old_logp=rows(old.tolist()), advantages=rows(ADV),
                       ref_logp=rows((logp - torch.tensor(KL_D)).tolist()),
                       rollout_logp=rows((old - torch.tensor(RHO).log()).tolist()))


def reference_actor_loss(model: torch.nn.Module, batch: Batch, cfg: PPOConfig,
                         correction: str = "none") -> tuple[torch.Tensor, dict[str, int]]:
    """The actor's mini-batch loss written out token by token, and how many tokens took
    each branch (so a test can check that its batch exercises them)."""
    a, cap = cfg.algo, cfg.pipeline.is_cap
    seqs, tokens = len(batch), int(batch.response_lens.sum())
    loss = torch.zeros(())
    seen = {"clipped": 0, "dual": 0, "capped": 0}
    stats = reference_logprobs(model, batch, cfg.rollout.temperature)
    for i, (logp, entropy) in enumerate(stats):
        col = {k: batch.packed[k].row(i).float() for k in
               ("old_logp", "advantages", "ref_logp", "rollout_logp")}
        for t in range(len(logp)):
            adv, old = float(col["advantages"][t]), float(col["old_logp"][t])
            ratio = torch.exp(logp[t] - old)
            low, high = 1 - a.clip_low, 1 + a.clip_high
            term = torch.maximum(-adv * ratio, -adv * ratio.clamp(low, high))
            r = float(ratio.detach())
            seen["clipped"] += -adv * min(max(r, low), high) > -adv * r
            if a.dual_clip is not None and adv < 0 and float(term.detach()) > -adv * a.dual_clip:
                term, seen["dual"] = torch.tensor(-adv * a.dual_clip), seen["dual"] + 1
            rho = math.exp(old - float(col["rollout_logp"][t]))
            seen["capped"] += rho > cap
            term = term * is_weight(correction, rho, cap)
            if a.kl_coef > 0 and a.kl_in == "loss":
                d = logp[t] - float(col["ref_logp"][t])
                kl = 0.5 * d * d if a.kl_kind == "k2" else torch.exp(-d) + d - 1
                term = term + a.kl_coef * kl
            term = term - a.entropy_coef * entropy[t]
            loss = loss + agg_weight(a.loss_agg, len(logp), tokens, seqs) * term
    return loss, seen


def one_rank(batch: Batch) -> Shard:
    """The whole batch as one rank's shard, cut into two micro-batches."""
    return Shard(index=0, batch=batch, micro_bounds=(0, 2, len(batch)))


def summed(result, name: str) -> float:  # noqa: ANN001 (a WorkerResult)
    """A "sum" metric over the result's micro-batches."""
    return sum(m.value for m in result.metrics if m.name == name)


def actor_update(cfg: PPOConfig, correction: str = "none") -> tuple[float, dict, float, dict]:
    """(the update's loss, its gradient, the reference loss, the reference gradient)."""
    worker = PolicyWorker(WorkerIdentity(role="policy", rank=0, world_size=1), config=cfg,
                          vocab_size=VOCAB, eos_id=EOS, pad_id=PAD, max_response_tokens=NORM_LEN)
    worker.setup()
    model = copy.deepcopy(worker.model)  # the weights the update starts from
    batch = actor_batch(model, cfg)
    worker.optimizer = GradRecorder(worker.model)
    result = worker.update(one_rank(batch), totals=Totals.of(batch, NORM_LEN), step=0)
    ref, seen = reference_actor_loss(model, batch, cfg, correction)
    assert seen["clipped"] >= 2 and seen["dual"] == 2 and seen["capped"] == 3, seen
    ref.backward()
    want = clipped_grads(model, cfg.train.grad_clip)
    return summed(result, "actor/loss"), worker.optimizer.grads, float(ref.detach()), want


def clipped_grads(model: torch.nn.Module, max_norm: float) -> dict[str, torch.Tensor]:
    """The model's gradients scaled to a global L2 norm of at most `max_norm`."""
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    return {n: g * min(1.0, max_norm / (norm + 1e-6)) for n, g in grads.items()}


def assert_same(loss: float, grads: dict, want_loss: float, want: dict) -> None:
    assert loss == pytest.approx(want_loss, abs=TOL, rel=TOL)
    assert grads.keys() == want.keys() and grads
    worst = max(float((grads[n] - want[n]).abs().max()) for n in grads)
    scale = max(float(g.abs().max()) for g in want.values())
    assert worst < TOL * max(1.0, scale), (worst, scale)


# ---- the actor ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", AGG_MODES)
def test_actor_update_is_the_clipped_loss_with_kl_and_entropy(mode: str) -> None:
    # Every term at once, in every aggregation mode: asymmetric and dual clip, the k3 KL in
    # the loss, the entropy bonus, temperature 0.7.
    cfg = config(f"algo.loss_agg={mode}", "algo.kl_coef=0.5", "algo.kl_in=loss",
                 "algo.kl_kind=k3", "algo.entropy_coef=0.2")
    assert_same(*actor_update(cfg))


def test_actor_update_with_the_k2_kl_and_no_entropy() -> None:
    assert_same(*actor_update(config("algo.kl_coef=0.5", "algo.kl_in=loss", "algo.kl_kind=k2")))


def test_actor_update_clips_the_gradient_norm() -> None:
    # A bound far below the gradient's norm: the step's gradient is scaled down to it.
    loss, grads, want_loss, want = actor_update(config("train.grad_clip=1e-3",
                                                       "algo.entropy_coef=0.2"))
    assert_same(loss, grads, want_loss, want)
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    assert norm == pytest.approx(1e-3, rel=1e-4)


def test_old_and_reference_logprobs_are_at_the_sampling_temperature() -> None:
    # The ratio's denominator (old_logp) and the KL's reference must be log-probs of the
    # policy the engine sampled from: softmax(logits / temperature).
    cfg = config("algo.kl_coef=0.1")
    worker = PolicyWorker(WorkerIdentity(role="policy", rank=0, world_size=1), config=cfg,
                          vocab_size=VOCAB, eos_id=EOS, pad_id=PAD, max_response_tokens=NORM_LEN)
    worker.setup()
    batch = token_batch()
    with torch.no_grad():
        want = reference_logprobs(worker.model, batch, cfg.rollout.temperature)
    logp = torch.cat([lp for lp, _ in want])
    entropy = torch.cat([e for _, e in want]).mean()
    for reference, name in ((False, "old_logp"), (True, "ref_logp")):
        result = worker.compute_logprobs(one_rank(batch), reference=reference)
        assert torch.allclose(result.outputs.packed[name].values, logp, atol=1e-5), name
    metrics = merge_metrics(worker.compute_logprobs(one_rank(batch)).metrics)
    assert metrics["actor/entropy"].value == pytest.approx(float(entropy), rel=1e-5)


# ---- the critic ---------------------------------------------------------------------------

# V_new - V_old and R - V_new per token. With value_clip 0.5 the clipped branch is the larger
# (and wins) where the new value moved more than 0.5 from the old one, towards the return.
MOVE = [0.7, -0.1, 0.9, -0.6, 0.05, 0.9, -0.3, 0.2, -0.8, 0.4]
TARGET = [0.4, 0.3, -1.0, -0.3, 0.5, 0.6, -0.2, 0.1, 0.5, -0.9]


@pytest.mark.parametrize("mode", AGG_MODES)
def test_critic_update_is_the_clipped_value_loss(mode: str) -> None:
    cfg = config(f"algo.loss_agg={mode}", "algo.value_clip=0.5")
    worker = CriticWorker(WorkerIdentity(role="critic", rank=0, world_size=1), config=cfg,
                          vocab_size=VOCAB, pad_id=PAD)
    worker.setup()
    model = copy.deepcopy(worker.model)
    with torch.no_grad():
        v = torch.cat([model(input_ids=token_batch().packed["tokens"].row(i)[None].long())
                       .logits[0, p - 1:p + r - 1, 0]
                       for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True))])
    batch = token_batch(values=rows((v - torch.tensor(MOVE)).tolist()),
                        returns=rows((v + torch.tensor(TARGET)).tolist()))
    worker.optimizer = GradRecorder(worker.model)
    result = worker.update(one_rank(batch), totals=Totals.of(batch, NORM_LEN), step=0)
    loss, clipped, seqs = torch.zeros(()), 0, len(batch)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True)):
        seq = batch.packed["tokens"].row(i)[None].long()
        values = model(input_ids=seq).logits[0, p - 1:p + r - 1, 0]
        for t in range(r):
            old, ret = float(batch.packed["values"].row(i)[t]), float(batch.packed["returns"]
                                                                      .row(i)[t])
            v_clip = old + (values[t] - old).clamp(-0.5, 0.5)
            term = 0.5 * torch.maximum((values[t] - ret) ** 2, (v_clip - ret) ** 2)
            clipped += abs(float(v_clip.detach()) - ret) > abs(float(values[t].detach()) - ret)
            loss = loss + agg_weight(mode, r, int(batch.response_lens.sum()), seqs) * term
    assert 2 <= clipped <= 8  # both branches are taken
    loss.backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    assert_same(summed(result, "critic/loss"), worker.optimizer.grads, float(loss.detach()), want)


# ---- the advantages the trainer computes -------------------------------------------------

def scored(truncated: list[float]) -> Batch:
    """Two groups of two responses with scores, values, old and reference log-probs."""
    g, tokens = torch.Generator().manual_seed(3), token_batch().packed["tokens"]
    per_token = {k: [torch.randn(r, generator=g) * s for r in RESPONSE_LENS]
                 for k, s in (("values", 0.5), ("old_logp", 0.3), ("ref_logp", 0.3))}
    return Batch.from_rows(sample_ids=range(4), prompt_lens=PROMPT_LENS,
                           response_lens=RESPONSE_LENS,
                           packed={"tokens": [tokens.row(i) for i in range(4)], **per_token},
                           scalars={"score": [1.0, 0.0, 0.5, 2.0], "group": [0, 0, 1, 1],
                                    "truncated": truncated})


def k3(batch: Batch, i: int) -> torch.Tensor:
    d = batch.packed["old_logp"].row(i) - batch.packed["ref_logp"].row(i)
    return torch.exp(-d) + d - 1


def test_ppo_advantages_are_gae_of_the_penalised_rewards_whitened() -> None:
    # gamma != lam (a swap shows), the KL in the reward, a truncation penalty, whitening.
    cfg = config("algo.gamma=0.9", "algo.lam=0.7", "algo.kl_coef=0.3", "algo.kl_in=reward",
                 "algo.kl_kind=k3", "algo.truncation=penalty", "algo.truncation_penalty=0.4")
    batch = scored([0.0, 1.0, 0.0, 1.0])
    out = compute_advantages(batch, cfg)
    advs, rets = [], []
    for i in range(len(batch)):
        v = batch.packed["values"].row(i).tolist()
        r = (-0.3 * k3(batch, i)).tolist()
        r[-1] += float(batch.scalars["score"][i]) - 0.4 * float(batch.scalars["truncated"][i])
        adv, running = [0.0] * len(v), 0.0
        for t in reversed(range(len(v))):
            next_v = v[t + 1] if t + 1 < len(v) else 0.0
            running = r[t] + 0.9 * next_v - v[t] + 0.9 * 0.7 * running
            adv[t] = running
        advs += adv
        rets += [x + y for x, y in zip(adv, v, strict=True)]
    adv = torch.tensor(advs)
    white = (adv - adv.mean()) / torch.sqrt(adv.var() + 1e-8)  # var: unbiased, as verl's
    assert torch.allclose(out.packed["returns"].values, torch.tensor(rets), atol=1e-5)
    assert torch.allclose(out.packed["advantages"].values, white, atol=1e-5)
    assert out.scalars["loss_mask"].tolist() == [1.0] * 4


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_advantages_are_group_scores_less_the_summed_kl(norm_by_std: bool) -> None:
    cfg = config("algo.name=grpo", "algo.kl_coef=0.3", "algo.kl_in=reward", "algo.kl_kind=k3",
                 f"algo.grpo_norm_by_std={norm_by_std}", "algo.truncation=mask")
    batch = scored([0.0, 1.0, 0.0, 0.0])
    out = compute_advantages(batch, cfg)
    s = [float(batch.scalars["score"][i]) - 0.3 * float(k3(batch, i).sum()) for i in range(4)]
    want = []
    for i in range(4):
        a, b = s[2 * (i // 2)], s[2 * (i // 2) + 1]  # i's group: (0, 1) or (2, 3)
        centred = s[i] - (a + b) / 2
        std = abs(a - b) / math.sqrt(2)  # unbiased std of two values
        want += [centred / (std + 1e-6) if norm_by_std else centred] * RESPONSE_LENS[i]
    assert torch.allclose(out.packed["advantages"].values, torch.tensor(want), atol=1e-5)
    assert out.scalars["loss_mask"].tolist() == [1.0, 0.0, 1.0, 1.0]
