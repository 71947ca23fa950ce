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
               lengths: list[int]) -> torch.Tensor:
    """The reference: each sequence alone, softmax(QK^T / sqrt(d) + causal) V written out,
    kv heads repeated per group. (1, h, N, d) inputs -> (1, N, h, d)."""
    outs, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lengths:
        qs = q[0, :, start:start + n]
        ks = k[0, :, start:start + n].repeat_interleave(group, dim=0)
        vs = v[0, :, start:start + n].repeat_interleave(group, dim=0)
        scores = qs @ ks.transpose(-1, -2) / math.sqrt(q.shape[-1])
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
