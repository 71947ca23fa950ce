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

Where the sequences start is worked out ONCE per forward (`columns.packed_inputs`, from the
row's offsets) and handed to every layer as transformers' flash-attention keyword arguments
(`varlen_kwargs`: `cu_seq_lens_q/k`, `max_length_q/k`), which the model forwards pass down to
the attention kernel. Reading the boundaries from the position ids in every layer (what
transformers' flash-attn path and this kernel did without them) makes the host wait for the
GPU in every layer, and again in every layer's activation-checkpoint recompute; with them,
a layer reads nothing back from the device.

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


def sequence_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Where each sequence of one packed row starts, from its position ids (0 where each
    begins): (cu_seqlens, longest), cu_seqlens = (sequences + 1,) int32 offsets, the last one
    the row's length — what flash-attn's varlen kernel takes.

    It reads the ids' values on the host (`nonzero`, `max`): a GPU forward waits for the
    device here. Compute it once per forward (`columns.packed_inputs` has it from the row's
    offsets) and pass it to every layer (`varlen_kwargs`), not once per layer.

    Example:
        >>> cu, longest = sequence_bounds(torch.tensor([[0, 1, 0, 0, 1, 2]]))
        >>> cu.tolist(), longest
        ([0, 2, 3, 6], 3)
    """
    positions = position_ids.reshape(-1)
    starts = (positions == 0).nonzero().flatten()
    cu = torch.cat([starts, torch.full((1,), len(positions), device=starts.device)])
    return cu.to(torch.int32), int(cu.diff().max()) if len(starts) else 0


def varlen_kwargs(cu_seqlens: torch.Tensor, longest: int) -> dict[str, torch.Tensor | int]:
    """The keyword arguments that carry a packed row's sequence boundaries down to every
    attention layer: transformers' model forwards pass them through (``**kwargs``) to the
    attention kernel, where flash-attn 2's varlen path and `packed_sdpa_attention` read them
    instead of working them out again from the position ids in every layer (and again in
    every layer's activation-checkpoint recompute). One query and one key run per sequence,
    so the q and k values are the same. `longest` is a Python int: no kernel reads it back
    from the device.

    Example:
        >>> kw = varlen_kwargs(torch.tensor([0, 2, 3], dtype=torch.int32), 2)
        >>> sorted(kw), kw["max_length_q"]
        (['cu_seq_lens_k', 'cu_seq_lens_q', 'max_length_k', 'max_length_q'], 2)
    """
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens,
            "max_length_q": longest, "max_length_k": longest}


def packed_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                          scaling: float | None = None, dropout: float = 0.0,
                          position_ids: torch.Tensor | None = None,
                          cu_seq_lens_q: torch.Tensor | None = None,
                          max_length_q: int | None = None,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention within each sequence of one packed row.

    `query` is (1, heads, N, dim), `key` and `value` (1, kv_heads, N, dim), `position_ids`
    (1, N), 0 where each sequence starts. Returns (1, N, heads, dim), as transformers' kernels
    do, and no attention weights. With `cu_seq_lens_q` and `max_length_q` (`varlen_kwargs`,
    computed once per forward) it reads nothing back from the device; without them it works
    them out from `position_ids` (`sequence_bounds`, two host syncs per call). `module`,
    `attention_mask` (always None here) and the other keyword arguments are transformers'
    calling convention.

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
    if cu_seq_lens_q is None or max_length_q is None:
        cu_seq_lens_q, max_length_q = sequence_bounds(position_ids)
    cu = cu_seq_lens_q.to(torch.int64)
    starts = cu[:-1]
    offsets = torch.arange(int(max_length_q), device=query.device)
    # (sequences, longest) indices into the row; past a sequence's end they run on into the
    # next sequence (or are clamped to the last token): keys no real query attends to.
    index = (starts[:, None] + offsets[None, :]).clamp(max=n_tokens - 1)

    def gathered(t: torch.Tensor) -> torch.Tensor:  # (1, h, N, d) -> (sequences, h, L, d)
        return t[0][:, index].transpose(0, 1)

    q, k, v = gathered(query), gathered(key), gathered(value)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves a group
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scaling, dropout_p=dropout)
    # Back to the row: token t of the row is (its sequence, t - that sequence's start). Integer
    # indices, not a boolean mask of the real positions: a mask's size is known only on the
    # host (a sync per layer); these are computed on the device.
    token = torch.arange(n_tokens, device=query.device)
    sequence = torch.searchsorted(cu[1:], token, right=True)
    within = token - starts[sequence]
    # (sequences, h, L, d) -> (sequences, L, h, d) -> (1, N, h, d)
    return out.transpose(1, 2)[sequence, within].unsqueeze(0), None


def register() -> str:
    """Make `PACKED_SDPA` a name transformers' models accept (idempotent); returns it."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    return PACKED_SDPA
