"""Chapter 5 — attention over a packed row, one sequence at a time, with PyTorch's SDPA.

The trainer runs a micro-batch as ONE row of its real tokens (`columns.packed_inputs`): the
sequences sit end to end, and their position ids restart at 0 where each begins. Attention
must not cross from one sequence into another. Given such a row, transformers' "eager" and
"sdpa" kernels build a block-diagonal (N x N) mask over all N tokens and compute every
query against every key, masked: N^2 work and memory where the sequences need only the sum
of their own L^2. On a micro-batch of 64 sequences of ~30 tokens that is ~60x the attention
work, and measured on CPU a forward + backward ~11x slower than the right-padded rows. (flash
attention 2 has a "varlen" kernel that takes the packed row as it is; it runs on CUDA only.)

`packed_sdpa_attention` does what that varlen kernel does, with SDPA: it reads where each
sequence starts from the position ids, gathers the row into (sequences, heads, longest, dim),
runs causal SDPA on that (a query never sees a key past itself, so the gathered tail of a
short sequence, which holds the next sequence's tokens, is never attended), and scatters the
real positions back into the packed row. Work: sequences x longest^2, no N x N mask.

It is registered in transformers' attention registry under `PACKED_SDPA` (`register`): a new
name beside transformers' own, so nothing the user's models run changes. A model set to it
must be given packed rows (batch size 1, position ids restarting at 0) and no attention mask:
transformers builds no mask for a kernel it does not know, so right-padded rows would attend
to their padding; `packed_sdpa_attention` refuses them.

Not here: which kernel the trainer picks (`models.trainer_attention`), building packed rows
(`columns`).
"""

from __future__ import annotations

from typing import Any

import torch

PACKED_SDPA = "avrid_packed_sdpa"
"""The kernel's name in transformers' registry (``model.set_attn_implementation``)."""


def packed_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                          scaling: float | None = None, dropout: float = 0.0,
                          position_ids: torch.Tensor | None = None,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention within each sequence of one packed row.

    `query` is (1, heads, N, dim), `key` and `value` (1, kv_heads, N, dim), `position_ids`
    (1, N), 0 where each sequence starts. Returns (1, N, heads, dim), as transformers' kernels
    do, and no attention weights. `module`, `attention_mask` (always None here) and the
    other keyword arguments are transformers' calling convention.

    Example (two sequences, of 2 and 1 tokens; the second attends to itself only):
        >>> q = k = v = torch.arange(6.0).reshape(1, 1, 3, 2)
        >>> out, _ = packed_sdpa_attention(None, q, k, v, None,
        ...                                position_ids=torch.tensor([[0, 1, 0]]))
        >>> out[0, 2, 0].tolist()
        [4.0, 5.0]
    """
    if query.shape[0] != 1 or position_ids is None or attention_mask is not None:
        raise ValueError(
            f"the {PACKED_SDPA!r} attention runs one packed row (batch size 1, position ids "
            f"restarting at 0 per sequence, no attention mask); got a batch of "
            f"{query.shape[0]}, position ids {'missing' if position_ids is None else 'given'}"
            f", a mask {'given' if attention_mask is not None else 'absent'}")
    n_tokens = query.shape[2]
    positions = position_ids[0]
    starts = (positions == 0).nonzero().flatten()
    ends = torch.cat([starts[1:], torch.full((1,), n_tokens, device=starts.device)])
    lengths = ends - starts
    longest = int(lengths.max())
    offsets = torch.arange(longest, device=starts.device)
    # (sequences, longest) indices into the row; past a sequence's end they run on into the
    # next sequence (or are clamped to the last token): keys no real query attends to.
    index = (starts[:, None] + offsets[None, :]).clamp(max=n_tokens - 1)
    real = offsets[None, :] < lengths[:, None]

    def gathered(t: torch.Tensor) -> torch.Tensor:  # (1, h, N, d) -> (sequences, h, L, d)
        return t[0][:, index].transpose(0, 1)

    q, k, v = gathered(query), gathered(key), gathered(value)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves a group
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scaling, dropout_p=dropout)
    # (sequences, h, L, d) -> (sequences, L, h, d), real positions in row order -> (1, N, h, d)
    return out.transpose(1, 2)[real].unsqueeze(0), None


def register() -> str:
    """Make `PACKED_SDPA` a name transformers' models accept (idempotent); returns it."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    return PACKED_SDPA
