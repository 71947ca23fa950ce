"""Chapter 5 — from a packed micro-batch to model inputs and back.

Dispatch moves packed rows (chapter 2); the model runs them packed too. This file does the
two conversions every worker needs:

- `model_inputs(batch)`: the micro-batch's full sequences (prompt + response) as model
  inputs and, for the response tokens, where their predicting logits sit: token j of a
  response is at position ``P + j`` of its sequence and is predicted by the logits at
  ``P + j - 1``. Two layouts: `packed_inputs`, one row of the real tokens (no padding: the
  position ids restarting at 0 mark the sequences), and `padded_inputs`, right-padded
  (n, longest); `memory.pack_sequences` picks the one training runs (packed by default);
- `padded(batch, column)` / `response_mask`: a packed per-response-token column as (n, T);
- `action_mask`: which response tokens the policy generated (chapter 7's multi-turn
  trajectories interleave them with observation tokens an environment returned): the mask
  every loss, advantage and per-token metric uses. `response_mask` stays the real response
  tokens (a prefix mask: re-packing with `packed` and the estimators' padding rely on it).

Every tensor made here is made on the batch's own device: a worker moves its micro-batch to
its model's device (`Batch.to`), and its inputs, masks and padded columns are then there too.

The loss weights that make data-parallel training exact are the RL math's
(`losses.token_weights`); `forward.train_shard` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from avrid.dispatch import Batch, Packed


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInputs:
    """A micro-batch ready for ``model(input_ids, attention_mask, position_ids)``: one packed
    row (`packed_inputs`) or right-padded (n, L) rows (`padded_inputs`)."""

    input_ids: torch.Tensor
    """(1, N) int64, N = the micro-batch's real tokens, packed; or (n, L) right-padded with
    `pad_id`, L = the longest prompt + response."""
    attention_mask: torch.Tensor
    """Shaped like `input_ids`, int64, 1 on real tokens: all ones when packed (the model is
    then called without it and reads the sequence boundaries from `position_ids` restarting
    at 0: a block-diagonal causal mask; `forward.run_model`)."""
    position_ids: torch.Tensor
    """Shaped like `input_ids`: 0.. from each sequence's first token (padding repeats 0)."""
    logit_index: torch.Tensor
    """(n, T) int64, T = longest response: for response token j of row i, where its
    predicting logits sit (prompt_len + j - 1 within the row; plus the row's offset in the
    packed row); padding points at 0."""
    response_ids: torch.Tensor
    """(n, T) int64 response tokens, right-padded with `pad_id`."""
    response_mask: torch.Tensor
    """(n, T) float32, 1 on real response tokens."""
    action_mask: torch.Tensor
    """(n, T) float32, 1 on the response tokens the policy generated (`action_mask`): what
    the losses and their metrics weight. `response_mask` itself when the batch has no
    "action_mask" column (every response token is the policy's)."""
    cu_seqlens: torch.Tensor | None = None
    """Packed: (n + 1,) int32, where each sequence starts in the row, then its length (the
    row's offsets, as flash-attn's varlen kernel takes them); None when right-padded. With
    `longest`, made once here so that no attention layer reads the boundaries back from the
    position ids (`packed_attention.varlen_kwargs`)."""
    longest: int = 0
    """Packed: the longest sequence's tokens (a Python int, read from the device once)."""


def model_inputs(batch: Batch, pad_id: int, *, packed: bool = True) -> ModelInputs:
    """The micro-batch in the layout training runs (`memory.pack_sequences`): `packed_inputs`
    (the default) or `padded_inputs`. Every trainer forward (log-probs, reference, values,
    both updates) builds its inputs here.

    Packed computes only the real tokens; its results equal the padded ones up to float
    summation order (tests/test_ppo_packed_logprobs.py). Not bit for bit: a padded row's sums
    run over its own length, a packed row's kernels see the whole micro-batch, so two
    IDENTICAL responses of a GRPO group can get log-probs that differ in the last bits where
    the padded layout gives them the same ones.
    """
    return packed_inputs(batch, pad_id) if packed else padded_inputs(batch, pad_id)


def packed_inputs(batch: Batch, pad_id: int) -> ModelInputs:
    """`batch.packed["tokens"]` (prompt + response per row) as ONE packed row, no padding.

    The rows are concatenated as they travel (a `Packed` column's values already are) and the
    position ids restart at 0 on each row's first token: transformers reads the boundaries
    from them when no attention mask is given and masks attention block-diagonally
    (`masking_utils.find_packed_sequence_indices`; flash-attn's varlen kernel on CUDA). So a
    micro-batch computes exactly its `micro_batch_tokens`, never a padded (n, longest) grid.

    Example:
        >>> b = Batch.from_rows(sample_ids=[0, 1], prompt_lens=[2, 1], response_lens=[1, 2],
        ...     packed={"tokens": [torch.tensor([5, 6, 7]), torch.tensor([5, 8, 9])]})
        >>> x = packed_inputs(b, pad_id=0)
        >>> x.position_ids.tolist(), x.logit_index.tolist(), x.response_ids.tolist()
        ([[0, 1, 2, 0, 1, 2]], [[1, 0], [3, 4]], [[7, 0], [8, 9]])
    """
    tokens = batch.packed["tokens"]
    total, starts = tokens.lengths, tokens.offsets[:-1]
    device = total.device
    n_tokens = int(tokens.offsets[-1]) if len(batch) else 0
    row = torch.repeat_interleave(torch.arange(len(batch), device=device), total)
    position_ids = torch.arange(n_tokens, device=device) - starts[row]
    input_ids = tokens.values.to(torch.int64)
    resp_mask = response_mask(batch)
    steps = torch.arange(resp_mask.shape[1], device=device)
    # The same place as `padded_inputs`' logit_index, shifted by where the row starts.
    within = batch.prompt_lens[:, None] - 1 + steps
    logit_index = (starts[:, None] + within) * resp_mask.long()
    response_ids = torch.where(resp_mask.bool(), input_ids[logit_index + 1], pad_id)
    return ModelInputs(input_ids=input_ids[None], attention_mask=torch.ones_like(input_ids)[None],
                       position_ids=position_ids[None], logit_index=logit_index,
                       response_ids=response_ids, response_mask=resp_mask,
                       action_mask=action_mask(batch),
                       cu_seqlens=tokens.offsets.to(torch.int32),
                       longest=int(total.max()) if len(batch) else 0)


def padded_inputs(batch: Batch, pad_id: int) -> ModelInputs:
    """The micro-batch right-padded to (n, longest): it computes n x longest tokens, of which
    only the real ones count (the packed layout's reference in the tests).

    Example:
        >>> b = Batch.from_rows(sample_ids=[0, 1], prompt_lens=[2, 1], response_lens=[1, 2],
        ...     packed={"tokens": [torch.tensor([5, 6, 7]), torch.tensor([5, 8, 9])]})
        >>> x = padded_inputs(b, pad_id=0)
        >>> x.logit_index.tolist(), x.response_ids.tolist()
        ([[1, 0], [0, 1]], [[7, 0], [8, 9]])
    """
    tokens = batch.packed["tokens"]
    total = tokens.lengths
    n, width = len(batch), int(total.max()) if len(batch) else 0
    device = total.device
    cols = torch.arange(width, device=device)
    attention = (cols < total[:, None]).to(torch.int64)
    input_ids = torch.full((n, width), pad_id, dtype=torch.int64, device=device)
    input_ids[attention.bool()] = tokens.values.to(torch.int64)
    position_ids = cols.expand(n, width) * attention
    resp_mask = response_mask(batch)
    steps = torch.arange(resp_mask.shape[1], device=device)
    logit_index = (batch.prompt_lens[:, None] - 1 + steps) * resp_mask.long()
    response_ids = torch.where(resp_mask.bool(), input_ids.gather(1, logit_index + 1), pad_id)
    return ModelInputs(input_ids=input_ids, attention_mask=attention, position_ids=position_ids,
                       logit_index=logit_index, response_ids=response_ids,
                       response_mask=resp_mask, action_mask=action_mask(batch))


def response_mask(batch: Batch) -> torch.Tensor:
    """(n, T) float32: 1 where row i has its j-th response token (T = longest response)."""
    width = int(batch.response_lens.max()) if len(batch) else 0
    lens = batch.response_lens
    return (torch.arange(width, device=lens.device) < lens[:, None]).float()


ACTION_MASK = "action_mask"
"""The optional packed per-response-token column (int or float, values 0/1, one per response
token like "rollout_logp"): 1 on a token the policy generated, 0 on an observation token (a
tool's or an environment's output inside a multi-turn response, chapter 7). The trainer
trains on the exact ids of the whole response, but only the policy's own tokens are actions:
losses, advantages, `Totals` and per-token metrics cover those. An observation token carries
rollout_logp 0 (no behaviour log-prob). A batch without the column trains every response
token, exactly as before the column existed."""

OPTIONAL_READS = (ACTION_MASK,)
"""Columns every trainer call reads when the batch has them (`reads`)."""


def action_mask(batch: Batch) -> torch.Tensor:
    """(n, T) float32: 1 where row i's j-th response token is an action (the policy's own),
    i.e. `response_mask` times the batch's "action_mask" column; `response_mask` itself
    without the column. Unlike `response_mask` it need not be a prefix: [a a o o a] is
    [1, 1, 0, 0, 1].

    Example:
        >>> b = Batch.from_rows(sample_ids=[0], prompt_lens=[1], response_lens=[3],
        ...     packed={"tokens": [torch.tensor([5, 6, 7, 8])],
        ...             "action_mask": [torch.tensor([1, 0, 1])]})
        >>> action_mask(b).tolist()
        [[1.0, 0.0, 1.0]]
    """
    mask = response_mask(batch)
    if ACTION_MASK not in batch.packed:
        return mask
    column = padded(batch, ACTION_MASK)
    if not bool(((column == 0) | (column == 1)).all()):
        raise ValueError(f"column {ACTION_MASK!r} must hold only 0 (observation token) and 1 "
                         f"(policy token); got values {sorted(set(column.unique().tolist()))}")
    return mask * column


def reads(batch: Batch, names: tuple[str, ...]) -> Batch:
    """`batch.only(*names)` plus the `OPTIONAL_READS` the batch has: what the driver sends a
    call whose role reads `names` (its ``*_READS``). A batch without "action_mask" sends
    exactly `names`; one with it sends it along, so every worker masks the same tokens."""
    return batch.only(*names, *(c for c in OPTIONAL_READS
                                if c in batch.packed and c not in names))


def padded(batch: Batch, column: str, fill: float = 0.0) -> torch.Tensor:
    """A packed per-response-token column as a right-padded (n, T) float32 tensor."""
    col = batch.packed[column]
    if not torch.equal(col.lengths, batch.response_lens):
        raise ValueError(f"column {column!r} must hold one value per response token")
    mask = response_mask(batch).bool()
    out = torch.full(mask.shape, fill, dtype=torch.float32, device=mask.device)
    out[mask] = col.values.float()
    return out


def packed(values: torch.Tensor, mask: torch.Tensor) -> Packed:
    """The inverse of `padded`: keep each row's masked (valid) entries, packed."""
    keep = mask.bool()
    offsets = torch.zeros(len(values) + 1, dtype=torch.int64, device=values.device)
    torch.cumsum(keep.sum(1), 0, out=offsets[1:])
    return Packed(values=values[keep], offsets=offsets)


def with_responses(prompts: Batch, generated: Batch) -> Batch:
    """Prompt rows + their generated "response" rows -> full sequences. Keeps the prompt
    batch's scalar columns and the generated per-token columns (e.g. "rollout_logp") and
    per-sample ones (e.g. "truncated")."""
    if not torch.equal(prompts.sample_ids, generated.sample_ids):
        raise ValueError("generated rows must come back in the prompt batch's order")
    prompt, response = prompts.packed["tokens"], generated.packed["response"]
    extra = {k: v for k, v in generated.packed.items() if k != "response"}
    return Batch(sample_ids=prompts.sample_ids, prompt_lens=prompts.prompt_lens,
                 response_lens=response.lengths,
                 packed={"tokens": _joined_rows(prompt, response), **extra},
                 scalars={**prompts.scalars, **generated.scalars})


def _joined_rows(first: Packed, second: Packed) -> Packed:
    """Row i = first's row i, then second's row i: one gather, not a cat per sample (this
    runs on the driver every step, over every sample)."""
    a, b = first.lengths, second.lengths
    device = a.device
    offsets = torch.zeros(len(a) + 1, dtype=torch.int64, device=device)
    torch.cumsum(a + b, 0, out=offsets[1:])
    # the row of each element, then its place in that row
    row = torch.repeat_interleave(torch.arange(len(a), device=device), a + b)
    t = torch.arange(int(offsets[-1]), device=device) - offsets[:-1][row]
    # Element t of row i comes from first's row i while t < a[i], else from second's, which
    # sits after all of first's values in `both`.
    src = torch.where(t < a[row], first.offsets[:-1][row] + t,
                      len(first.values) + second.offsets[:-1][row] + t - a[row])
    both = torch.cat([first.values, second.values])
    return Packed(values=both[src], offsets=offsets)


def add_columns(batch: Batch, *, packed: dict[str, Packed] | None = None,
                scalars: dict[str, torch.Tensor] | None = None) -> Batch:
    """`batch` with more columns (a batch is frozen: this makes a new one)."""
    return Batch(sample_ids=batch.sample_ids, prompt_lens=batch.prompt_lens,
                 response_lens=batch.response_lens, packed={**batch.packed, **(packed or {})},
                 scalars={**batch.scalars, **(scalars or {})})


@dataclass(frozen=True, slots=True, kw_only=True)
class Totals:
    """Global counts of one mini-batch (all ranks), the denominators of its loss."""

    tokens: int
    """Action tokens (`action_mask`: every valid response token without the column) of the
    samples that train."""
    seqs: int
    """Sequences in the mini-batch that train (with an "action_mask" column: those with at
    least one action token; a row without any has no loss to give)."""
    norm_len: int
    """The longest allowed response (Dr.GRPO's constant for seq-mean-token-sum-norm)."""

    @classmethod
    def of(cls, batch: Batch, norm_len: int) -> Totals:
        """Count `batch` (the whole mini-batch, on the driver), leaving out the samples that
        `sample_loss_mask` excludes: the loss is the mean over the samples that train. With an
        "action_mask" column only action tokens count (observation tokens weigh nothing)."""
        keep = sample_loss_mask(batch) != 0
        if ACTION_MASK not in batch.packed:
            lens = batch.response_lens[keep]
            return cls(tokens=int(lens.sum()), seqs=len(lens), norm_len=norm_len)
        actions = action_mask(batch).sum(1)[keep]
        return cls(tokens=int(actions.sum()), seqs=int((actions > 0).sum()), norm_len=norm_len)


def sample_loss_mask(batch: Batch) -> torch.Tensor:
    """(n,) float32: 1 for a sample that takes part in the actor and critic losses, 0 for one
    left out — the batch's "loss_mask" scalar column (`trainer.compute_advantages` writes it,
    e.g. 0 for truncated responses under algo.truncation=mask); all ones without it."""
    keep = batch.scalars.get("loss_mask")
    return (torch.ones(len(batch), device=batch.sample_ids.device) if keep is None
            else keep.float())
