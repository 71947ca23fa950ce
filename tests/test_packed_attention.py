"""Chapter 5 — `packed_attention`: SDPA over a packed row, one sequence at a time.

The kernel the trainer runs on packed rows by default (`memory.attention` auto/sdpa, without
flash-attn) must compute, for every sequence of the row, causal attention over that sequence
alone: the same as running each sequence by itself, with and without grouped-query heads,
for sequences of one token and a row holding one sequence, gradients included. It must refuse
what it cannot run (right-padded rows, which transformers gives it without a mask).

Not here: the whole trainer's packed == padded equalities (tests/test_ppo_packed_logprobs.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from avrid.ppo.engines.packed_attention import PACKED_SDPA, packed_sdpa_attention, register

pytestmark = pytest.mark.chapter(5)


def one_by_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               lengths: list[int], scaling: float | None = None) -> torch.Tensor:
    """The reference: each sequence alone, softmax(QK^T * scaling + causal) V written out
    (scaling 1 / sqrt(d) by default), kv heads repeated per group. (1, h, N, d) inputs ->
    (1, N, h, d)."""
    outs, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lengths:
        qs = q[0, :, start:start + n]
        ks = k[0, :, start:start + n].repeat_interleave(group, dim=0)
        vs = v[0, :, start:start + n].repeat_interleave(group, dim=0)
        scale = 1 / math.sqrt(q.shape[-1]) if scaling is None else scaling
        scores = qs @ ks.transpose(-1, -2) * scale
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        outs.append((weights @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)[None]


def positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]


@pytest.mark.parametrize("lengths", [[3, 1, 5, 2], [7], [1, 1, 1], [2, 9, 1, 4, 4]])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_each_sequence_attends_to_itself_alone_and_gradients_agree(
        lengths: list[int], kv_heads: int) -> None:
    g = torch.Generator().manual_seed(sum(lengths) + kv_heads)
    n = sum(lengths)
    q = torch.randn(1, 4, n, 8, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, n, 8, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, n, 8, generator=g, requires_grad=True)
    up = torch.randn(1, n, 4, 8, generator=g)  # a random upstream gradient

    out, weights = packed_sdpa_attention(None, q, k, v, None, position_ids=positions(lengths))
    assert weights is None and out.shape == (1, n, 4, 8)
    grads = torch.autograd.grad((out * up).sum(), (q, k, v))
    want = one_by_one(q, k, v, lengths)
    want_grads = torch.autograd.grad((want * up).sum(), (q, k, v))
    assert torch.allclose(out, want, atol=1e-6)
    for got, ref in zip(grads, want_grads, strict=True):
        assert torch.allclose(got, ref, atol=1e-5)


def test_the_modules_scaling_is_used_not_sdpas_default() -> None:
    # Qwen2 and Llama scale by 1 / sqrt(head dim), SDPA's default; a model whose config sets
    # another (Granite's attention_multiplier, Gemma 2's query_pre_attn_scalar) passes it as
    # `scaling`, and the packed row must use it: the kernel alone, then a whole model.
    from transformers import GraniteConfig, GraniteForCausalLM

    g = torch.Generator().manual_seed(0)
    lengths = [3, 5, 2]
    q, k, v = (torch.randn(1, 2, 10, 8, generator=g) for _ in range(3))
    out, _ = packed_sdpa_attention(None, q, k, v, None, scaling=0.9,
                                   position_ids=positions(lengths))
    assert torch.allclose(out, one_by_one(q, k, v, lengths, scaling=0.9), atol=1e-6)

    config = GraniteConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           attention_multiplier=0.9, max_position_embeddings=64)
    torch.manual_seed(0)
    model = GraniteForCausalLM(config).eval()
    attention = model.model.layers[0].self_attn
    assert attention.scaling == 0.9 != attention.head_dim ** -0.5
    seqs = [torch.randint(0, 32, (n,), generator=g) for n in lengths]
    model.set_attn_implementation("sdpa")  # each sequence alone, transformers' own kernel
    want = torch.cat([model(s[None]).logits[0] for s in seqs])
    model.set_attn_implementation(register())
    got = model(torch.cat(seqs)[None], position_ids=positions(lengths)).logits[0]
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())


def test_a_padded_batch_or_a_mask_is_refused_naming_what_it_needs() -> None:
    q = torch.zeros(2, 1, 3, 4)
    with pytest.raises(ValueError, match="one packed row .* got a batch of 2"):
        packed_sdpa_attention(None, q, q, q, None, position_ids=torch.zeros(2, 3, dtype=int))
    with pytest.raises(ValueError, match="position ids missing"):
        packed_sdpa_attention(None, q[:1], q[:1], q[:1], None)
    with pytest.raises(ValueError, match="a mask given"):
        packed_sdpa_attention(None, q[:1], q[:1], q[:1], torch.ones(1, 1, 3, 3),
                              position_ids=torch.zeros(1, 3, dtype=int))


def test_registering_adds_one_name_and_changes_no_other_kernel() -> None:
    from transformers import AttentionInterface

    before = {name: AttentionInterface._global_mapping[name]
              for name in AttentionInterface._global_mapping}
    assert register() == register() == PACKED_SDPA  # idempotent
    after = AttentionInterface._global_mapping
    assert after[PACKED_SDPA] is packed_sdpa_attention
    assert {n: f for n, f in after.items() if n != PACKED_SDPA} == {
        n: f for n, f in before.items() if n != PACKED_SDPA}
