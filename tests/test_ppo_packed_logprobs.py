"""Chapter 5 — the trainer's packed, chunked forward computes what the padded, full one did.

The trainer can run each micro-batch as ONE packed row (`columns.packed_inputs`: position
ids restarting at 0 mark the sequences, no padding; `memory.pack_sequences`) and turns
hidden states into log-probs a chunk of positions at a time (`logprobs.chunked_logprobs`),
never holding (tokens x vocab) logits. These tests pin the numerics contract of issue 28,
in fp32 on CPU:

- packed == right-padded (`columns.padded_inputs`, the old layout) for log-probs, entropies,
  values, both losses and every parameter's gradient (relative 1e-5);
- chunked == full logits (1e-6), with grad and with a tied embedding (Qwen2.5-0.5B ties its
  LM head to the embedding), at chunk sizes that do and do not divide the positions;
- one batch at three token budgets (`micro_batch_tokens`) and two micro-batch sizes gives the
  same log-probs (1e-6) and, after a real AdamW step of the actor, the same weights (1e-5),
  in both layouts.

Not here: the FSDP2 (dp = 2) runs of the same code (tests/test_ppo_dp_equivalence.py) and
the rollout engines' log-probs (tests/test_ppo_rollout.py).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from avrid.dispatch import Batch, DispatchConfig, Packed, Shard, make_plan
from avrid.ppo.algo.logprobs import chunked_logprobs, entropy_from_logits, logprobs_from_logits
from avrid.ppo.algo.losses import policy_loss, value_loss
from avrid.ppo.data.columns import Totals, model_inputs, packed_inputs, padded, padded_inputs
from avrid.ppo.engines.models import (
    TinyModelSpec,
    build_tiny_critic,
    build_tiny_policy,
    trainer_attention,
)
from avrid.ppo.engines.packed_attention import PACKED_SDPA, register
from avrid.ppo.roles.forward import response_logprobs, response_values
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.memory_estimate import attention_kernel
from avrid.ppo.setup.overrides import with_overrides
from avrid.workers import WorkerIdentity
from tests.helpers import ragged_batch

pytestmark = pytest.mark.chapter(5)

VOCAB, PAD, EOS = 40, 0, 1
SPEC = TinyModelSpec(vocab_size=VOCAB, hidden_size=32, num_heads=2, num_kv_heads=2)
# A length-skewed batch: a few long responses among short ones, ragged prompts.
PROMPT_LENS = [3, 1, 5, 2, 4, 2, 3, 1]
RESPONSE_LENS = [2, 14, 1, 3, 11, 2, 1, 4]


def make_batch(seed: int = 0) -> Batch:
    return ragged_batch(PROMPT_LENS, RESPONSE_LENS, vocab=VOCAB,
                        sample_ids=range(100, 100 + len(PROMPT_LENS)), seed=seed,
                        columns={"old_logp": 0.1, "advantages": 1.0, "values": 0.5,
                                 "returns": 1.0})

def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (the scale of the compared quantity)."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def test_packed_inputs_are_one_row_of_the_real_tokens() -> None:
    batch = make_batch()
    x = packed_inputs(batch, PAD)
    assert x.input_ids.shape == (1, sum(PROMPT_LENS) + sum(RESPONSE_LENS))  # no padding
    assert torch.equal(x.input_ids[0], batch.packed["tokens"].values)
    starts = (x.position_ids[0] == 0).nonzero().flatten().tolist()
    assert starts == batch.packed["tokens"].offsets[:-1].tolist()
    ref = padded_inputs(batch, PAD)
    assert torch.equal(x.response_ids, ref.response_ids)
    assert torch.equal(x.response_mask, ref.response_mask)


# (kernel on the packed row, kernel on the padded rows): the trainer's default on CPU
# (`packed_attention`'s per-sequence SDPA; the padded rows run transformers' SDPA), and eager
# and transformers' SDPA on both, over a block-diagonal mask. Each must keep the packed row's
# sequences apart.
ATTENTION = [(register(), "sdpa"), ("sdpa", "sdpa"), ("eager", "eager")]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("tied", [False, True])
def test_packed_equals_padded_for_logprobs_losses_and_every_gradient(tied: bool,
                                                                     attention: tuple) -> None:
    spec = TinyModelSpec(vocab_size=VOCAB, hidden_size=32, num_heads=2, num_kv_heads=2,
                         tie_embeddings=tied)
    model = build_tiny_policy(spec, seed=3)
    kernel = dict(zip(("packed", "padded"), attention, strict=True))
    batch = make_batch()
    results = {}
    for name, x in (("packed", packed_inputs(batch, PAD)), ("padded", padded_inputs(batch, PAD))):
        model.set_attn_implementation(kernel[name])
        logp, ent = response_logprobs(model, x, 0.7, with_entropy=True, chunk=5)
        mask = x.response_mask
        out = policy_loss(logp, padded(batch, "old_logp"), padded(batch, "advantages"), mask,
                          clip_low=0.2, clip_high=0.2, dual_clip=3.0)
        loss = (out.per_token * mask).sum() / mask.sum() - 0.01 * (ent * mask).sum()
        loss.backward()
        valid = mask.bool()
        results[name] = (logp.detach()[valid], ent.detach()[valid], loss.detach(),
                         grads_of(model))
    (lp, en, lo, gr), (lp0, en0, lo0, gr0) = results["packed"], results["padded"]
    assert rel(lp, lp0) < 1e-5 and rel(en, en0) < 1e-5 and rel(lo, lo0) < 1e-5
    assert gr.keys() == gr0.keys() and len(gr) == len(list(model.parameters()))
    worst = max(rel(gr[n], gr0[n]) for n in gr)
    assert worst < 1e-5, worst


@pytest.mark.parametrize("attention", ATTENTION)
def test_packed_equals_padded_for_values_the_value_loss_and_every_gradient(
        attention: tuple) -> None:
    critic = build_tiny_critic(SPEC, seed=4)
    kernel = dict(zip(("packed", "padded"), attention, strict=True))
    batch = make_batch()
    results = {}
    for name, x in (("packed", packed_inputs(batch, PAD)), ("padded", padded_inputs(batch, PAD))):
        critic.set_attn_implementation(kernel[name])
        values = response_values(critic, x)
        out = value_loss(values, padded(batch, "values"), padded(batch, "returns"),
                         x.response_mask, clip=0.2)
        loss = (out.per_token * x.response_mask).sum()
        loss.backward()
        results[name] = (values.detach()[x.response_mask.bool()], loss.detach(),
                         grads_of(critic))
    (v, lo, gr), (v0, lo0, gr0) = results["packed"], results["padded"]
    assert rel(v, v0) < 1e-5 and rel(lo, lo0) < 1e-5
    assert gr.keys() == gr0.keys() and len(gr) == len(list(critic.parameters()))
    worst = max(rel(gr[n], gr0[n]) for n in gr)
    assert worst < 1e-5, worst


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_equals_full_logits_with_grad(chunk: int, tied: bool) -> None:
    spec = TinyModelSpec(vocab_size=VOCAB, hidden_size=32, num_heads=2, num_kv_heads=2,
                         tie_embeddings=tied)
    model = build_tiny_policy(spec, seed=5)
    head = model.get_output_embeddings()
    assert (head.weight is model.model.embed_tokens.weight) == tied
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 32, generator=g, requires_grad=True)
    tokens = torch.randint(0, VOCAB, (50,), generator=g)
    w = torch.randn(50, generator=g)
    results = []
    for chunked in (True, False):
        if chunked:
            logp, ent = chunked_logprobs(hidden, head, tokens, 0.6, chunk=chunk,
                                         with_entropy=True)
        else:
            logits = head(hidden)
            logp, ent = logprobs_from_logits(logits, tokens, 0.6), entropy_from_logits(logits, 0.6)
        ((logp * w).sum() + (ent * w).sum()).backward()
        results.append((logp.detach(), ent.detach(), hidden.grad.clone(),
                        head.weight.grad.clone()))
        hidden.grad, head.weight.grad = None, None
    (logp, ent, g_hidden, g_head), (logp0, ent0, g_hidden0, g_head0) = results
    assert float((logp - logp0).abs().max()) < 1e-6
    assert float((ent - ent0).abs().max()) < 1e-6
    # Gradients sum over positions (the head's over all 50): relative to their scale.
    assert rel(g_hidden, g_hidden0) < 1e-6 and rel(g_head, g_head0) < 1e-6


def test_an_empty_micro_batch_still_reaches_every_parameter() -> None:
    # Under FSDP every rank's backward must touch the same parameters (the LM head
    # included), or the gradient reduce-scatter would not line up across ranks.
    model = build_tiny_policy(SPEC, seed=0)
    empty = make_batch().slice(0, 0)
    logp, _ = response_logprobs(model, packed_inputs(empty, PAD), 1.0)
    assert logp.shape == (0, 0)
    logp.sum().backward()
    grads = grads_of(model)
    assert len(grads) == len(list(model.parameters()))
    assert all(float(g.abs().max()) == 0.0 for g in grads.values())


# ---- one batch, many ways of cutting it into micro-batches ----------------------------------

def config(pack: bool) -> PPOConfig:
    return with_overrides(PPOConfig(), [
        "placement.backend=inprocess", "placement.actor_dp=1", "placement.critic_dp=1",
        "model.hidden_size=32", "model.num_heads=2", "train.grad_clip=1e9",
        "algo.kl_coef=0.0", "algo.entropy_coef=0.01", f"memory.pack_sequences={pack}"])


def cuts(batch: Batch) -> dict[str, Shard]:
    """The same batch as one rank's shard, cut by three token budgets (the dispatch plan,
    which also reorders the samples) and into micro-batches of 2 and 3 samples."""
    out = {}
    for budget in (12, 30, 1000):
        plan = make_plan(batch, 1, DispatchConfig(micro_batch_tokens=budget))
        out[f"tokens={budget}"] = plan.split(batch)[0]
    for size in (2, 3):
        bounds = (*range(0, len(batch), size), len(batch))
        out[f"samples={size}"] = Shard(index=0, batch=batch, micro_bounds=bounds)
    return out


def logprobs_by_sample(model: torch.nn.Module, shard: Shard, *,
                       pack: bool) -> dict[int, torch.Tensor]:
    out = {}
    with torch.no_grad():
        for mb in shard.micro_batches():
            x = model_inputs(mb, PAD, packed=pack)
            logp, _ = response_logprobs(model, x, 1.0, chunk=4)
            for i, sid in enumerate(mb.sample_ids.tolist()):
                out[sid] = logp[i, :int(mb.response_lens[i])]
    return out


@pytest.mark.parametrize("pack", [False, True])
def test_token_budget_and_micro_batch_size_change_no_logprob_and_no_update(
        pack: bool) -> None:
    # Both layouts the trainer can run (`memory.pack_sequences`), through the real worker.
    cfg, batch = config(pack), make_batch()
    shards = cuts(batch)
    assert len({tuple(s.micro_bounds) for s in shards.values()}) == len(shards)  # all differ
    model = build_tiny_policy(SPEC, seed=0)
    ref = logprobs_by_sample(model, Shard(index=0, batch=batch, micro_bounds=(0, len(batch))),
                             pack=pack)
    for name, shard in shards.items():
        got = logprobs_by_sample(model, shard, pack=pack)
        worst = max(float((got[s] - ref[s]).abs().max()) for s in ref)
        assert worst < 1e-6, (name, worst)

    # The update: old log-probs a little off the current ones, so the ratio clips somewhere.
    old = torch.cat([ref[s] for s in batch.sample_ids.tolist()]) - 0.05
    old_logp = Packed(values=old, offsets=batch.packed["advantages"].offsets)
    batch = Batch(sample_ids=batch.sample_ids, prompt_lens=batch.prompt_lens,
                  response_lens=batch.response_lens, scalars=batch.scalars,
                  packed={**batch.packed, "old_logp": old_logp})
    weights, grads = {}, {}
    for name, shard in cuts(batch).items():
        worker = PolicyWorker(WorkerIdentity(role="policy", rank=0, world_size=1), config=cfg,
                              vocab_size=SPEC.vocab_size, eos_id=EOS, pad_id=PAD,
                              max_response_tokens=16)
        worker.setup()
        before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
        step = worker.optimizer.step

        def keep_grads_then_step(worker=worker, name=name, step=step) -> None:
            grads[name] = {n: p.grad.clone() for n, p in worker.model.named_parameters()}
            step()

        worker.optimizer.step = keep_grads_then_step
        worker.update(shard, totals=Totals.of(batch, 16), step=0)
        weights[name] = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
        assert all(not torch.equal(before[n], weights[name][n]) for n in before)  # it trained
        worker.close()
    first, first_grads = weights.pop("tokens=1000"), grads.pop("tokens=1000")
    for name, w in weights.items():
        worst = max(rel(grads[name][n], first_grads[n]) for n in first)
        assert worst < 1e-5, (name, "gradient", worst)
        # All weights as one vector: AdamW's first step is about lr * sign(gradient), so a
        # gradient that is 0 up to rounding (e.g. a key bias: softmax ignores a shift)
        # takes an arbitrary sign in every summation order; over the model that is noise.
        diff = torch.cat([(w[n] - first[n]).flatten() for n in first]).norm()
        scale = torch.cat([first[n].flatten() for n in first]).norm()
        assert float(diff / scale) < 1e-5, (name, "weights", float(diff / scale))


@pytest.mark.parametrize(("choice", "kernel"), [("auto", PACKED_SDPA), ("eager", "eager")])
def test_the_trained_model_and_the_reference_run_the_configured_attention(
        choice: str, kernel: str) -> None:
    cfg = with_overrides(config(True), [f"memory.attention={choice}", "algo.kl_coef=0.1"])
    worker = PolicyWorker(WorkerIdentity(role="policy", rank=0, world_size=1), config=cfg,
                          vocab_size=SPEC.vocab_size, eos_id=EOS, pad_id=PAD,
                          max_response_tokens=16)
    worker.setup()
    try:
        assert worker.model.config._attn_implementation == kernel
        assert worker.reference.config._attn_implementation == kernel
    finally:
        worker.close()


def test_flash_attention_is_refused_off_cuda_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"memory.attention.*CUDA only.*'auto', 'sdpa'"):
        with_overrides(PPOConfig(), ["memory.attention=flash_attention_2"])
    with pytest.raises(ValueError, match=r"memory.attention.*allowed: auto, eager, sdpa"):
        with_overrides(PPOConfig(), ["memory.attention=flash"])


def test_flash_attention_is_picked_for_bf16_only_and_refused_for_fp32(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA with flash-attn installed (both faked here), "auto" once picked flash-attn for
    the default fp32 model too, and flash-attn raised "only supports fp16 and bf16" at the
    first forward: it is for bf16 compute only, in the trainer and in the estimate alike."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: (
        object() if name == "flash_attn" else find_spec(name, *rest)))
    assert trainer_attention("auto", "cuda", packed=True, dtype=torch.bfloat16) == \
        "flash_attention_2"
    assert trainer_attention("auto", "cuda", packed=True, dtype=torch.float32) == PACKED_SDPA
    assert trainer_attention("auto", "cuda", packed=False, dtype=torch.float32) == "sdpa"
    cuda = ["placement.device=cuda", "placement.backend=ray"]
    assert attention_kernel(with_overrides(PPOConfig(), cuda)) == "packed sdpa"
    assert attention_kernel(with_overrides(PPOConfig(), [*cuda, "model.dtype=bfloat16"])) == \
        "flash_attention_2"
    with pytest.raises(ValueError) as caught:
        with_overrides(PPOConfig(), [*cuda, "memory.attention=flash_attention_2"])
    assert "\n" not in str(caught.value)
    assert "memory.attention" in str(caught.value)
    assert "bf16/fp16 only, but model.dtype='float32'" in str(caught.value)
    with_overrides(PPOConfig(), [*cuda, "memory.attention=flash_attention_2",
                                 "model.dtype=bfloat16"])  # allowed


def test_with_grad_only_one_chunks_logits_are_ever_kept_for_backward() -> None:
    # The memory check (`benchmarks/train_memory.py` measures the lean trainer's peak): what
    # autograd keeps between forward and backward, counted by storage. Checkpointed, a
    # chunk's logits are recomputed in backward, so the forward keeps next to nothing; kept,
    # every chunk's (positions x vocab) logits and softmax would stay until backward.
    head = torch.nn.Linear(16, 1000, bias=False)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(256, 16, generator=g, requires_grad=True)
    tokens = torch.randint(0, 1000, (256,), generator=g)
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = chunked_logprobs(hidden, head, tokens, 0.7, chunk=32, with_entropy=True)
    logits_bytes = 256 * 1000 * 4  # one (positions x vocab) fp32 tensor, all chunks
    total = sum(kept.values())
    assert total <= logits_bytes / 8 + hidden.nbytes + head.weight.nbytes, \
        f"{total} bytes kept for backward in {len(kept)} tensors (all logits: {logits_bytes})"
    (logp.sum() + ent.sum()).backward()  # and it still backpropagates
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
