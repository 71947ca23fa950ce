"""Chapter 5 — the actor's and critic's compute on one micro-batch, and the training walk.

What a policy or critic worker does with a shard, as functions of (model, micro-batch):

- `response_logprobs`: one full-sequence forward, then the log-prob of every response token
  (and its entropy) — the "old log-probs", the reference log-probs and, with grad, the
  log-probs inside the PPO loss;
- `response_values`: the critic's value at the position that predicts each response token;
- `train_shard`: the one loop both updates share — zero grads, forward/backward every
  micro-batch with the loss weighted by GLOBAL denominators (`batching.loss_weights`), clip
  the global gradient norm, step. Gradient accumulation over micro-batches and the FSDP
  reduce-scatter over ranks then give exactly the mini-batch's loss gradient.

The losses themselves are in `losses.py`; the workers that call this are `policy_worker.py`
and `critic_worker.py`. Nothing here talks to Ray or knows which rank it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from avrid.dispatch import Batch, Shard
from avrid.ppo.batching import ModelInputs, loss_weights, model_inputs
from avrid.ppo.logprobs import entropy_from_logits, logprobs_from_logits
from avrid.results import ResultBuilder


def response_logprobs(model: torch.nn.Module, x: ModelInputs, temperature: float, *,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(n, T) log-probs of the response tokens (and (n, T) entropies if asked)."""
    logits = model(input_ids=x.input_ids, attention_mask=x.attention_mask,
                   position_ids=x.position_ids, use_cache=False).logits
    # Only the positions that predict response tokens: (n, T, vocab), not (n, L, vocab).
    index = x.logit_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    picked = logits.gather(1, index)
    logp = logprobs_from_logits(picked, x.response_ids, temperature)
    entropy = entropy_from_logits(picked, temperature) if with_entropy else None
    return logp, entropy


def response_values(critic: torch.nn.Module, x: ModelInputs) -> torch.Tensor:
    """(n, T) values V(s_t) at the positions that predict each response token."""
    out = critic(input_ids=x.input_ids, attention_mask=x.attention_mask,
                 position_ids=x.position_ids, use_cache=False).logits.squeeze(-1).float()
    return out.gather(1, x.logit_index)


@dataclass(frozen=True, slots=True, kw_only=True)
class Totals:
    """Global counts of one mini-batch (all ranks), the denominators of its loss."""

    tokens: int
    """Valid response tokens in the mini-batch."""
    seqs: int
    """Sequences in the mini-batch."""
    norm_len: int
    """The longest allowed response (Dr.GRPO's constant for seq-mean-token-sum-norm)."""

    @classmethod
    def of(cls, batch: Batch, norm_len: int) -> Totals:
        """Count `batch` (the whole mini-batch, on the driver)."""
        return cls(tokens=int(batch.response_lens.sum()), seqs=len(batch), norm_len=norm_len)


LossFn = Callable[[ModelInputs, Batch, torch.Tensor, ResultBuilder], torch.Tensor]
"""(inputs, micro-batch, per-token weights, builder) -> the micro-batch's weighted loss."""


def train_shard(model: torch.nn.Module, optimizer: torch.optim.Optimizer, shard: Shard,
                builder: ResultBuilder, loss_fn: LossFn, *, pad_id: int, agg: str,
                totals: Totals, world_size: int, grad_clip: float, prefix: str) -> None:
    """One optimizer step on this rank's shard of a mini-batch (see the module docstring)."""
    optimizer.zero_grad(set_to_none=True)
    for mb in shard.micro_batches():
        with builder.span("forward_backward"):
            x = model_inputs(mb, pad_id)
            w = loss_weights(x.response_mask, agg, global_tokens=totals.tokens,
                             global_seqs=totals.seqs, norm_len=totals.norm_len,
                             world_size=world_size)
            loss = loss_fn(x, mb, w, builder)
            loss.backward()
        # An update returns no columns, but the canonical result still accounts for every
        # sample it was sent (chapter 3), so the driver knows none was dropped.
        builder.add(mb.sample_ids)
        # Each rank's weighted loss is its share of the mini-batch loss times world_size.
        builder.metric(f"{prefix}/loss", float(loss.detach()) / world_size, "sum")
    with builder.span("optimizer"):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2: the same value everywhere
            norm = norm.full_tensor()
        builder.metric(f"{prefix}/grad_norm", float(norm), "max")
        if torch.isfinite(norm):
            optimizer.step()
        else:  # a NaN step would poison every weight; skip it and let the metric show it
            builder.metric(f"{prefix}/skipped_steps", 1.0, "max")
        optimizer.zero_grad(set_to_none=True)
