"""Chapter 5 — the actor's and critic's compute on one micro-batch, and the training walk.

What a policy or critic worker does with a shard, as functions of (model, micro-batch):

- `response_logprobs`: one full-sequence forward, then the log-prob of every response token
  (and its entropy) — the "old log-probs", the reference log-probs and, with grad, the
  log-probs inside the PPO loss;
- `response_values`: the critic's value at the position that predicts each response token;
- `train_shard`: the one loop both updates share — zero grads, forward/backward every
  micro-batch with the loss weighted by GLOBAL denominators (`losses.token_weights`), clip
  the global gradient norm, step. Gradient accumulation over micro-batches and the FSDP
  reduce-scatter over ranks then give exactly the mini-batch's loss gradient.

Device discipline: a micro-batch arrives on the CPU (that is what travels between
processes); the model may sit on a GPU. Each role method moves the micro-batch it reads to
`model_device(model)` once (`Batch.to`, free when it is there already), computes there, and
hands its outputs to the `ResultBuilder`, which keeps CPU copies: a result leaving a worker
holds CPU tensors only.

The losses themselves are in `losses.py`; the workers that call this are `roles/policy.py`
and `roles/critic.py`. Nothing here talks to Ray or knows which rank it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from avrid.dispatch import Batch, Shard
from avrid.ppo.algo.logprobs import entropy_from_logits, logprobs_from_logits
from avrid.ppo.algo.losses import token_weights
from avrid.ppo.data.columns import ModelInputs, Totals, model_inputs, sample_loss_mask
from avrid.results import ResultBuilder


def model_device(model: torch.nn.Module) -> torch.device:
    """Where `model` computes: the device of its parameters. Under FSDP2 they are DTensors,
    whose `.device` is this rank's local device; the frozen reference and a dp = 1 actor
    or critic are plain modules."""
    return next(model.parameters()).device


def forward(model: torch.nn.Module, x: ModelInputs) -> torch.Tensor:
    """The model's (n, L, out) logits for a micro-batch.

    An empty micro-batch (a rank whose shard is smaller than its peers', or empty) still runs
    the model, on one token, and returns zero rows cut from that output. Under FSDP every
    rank must take part in each layer's all-gather, and in training in its gradient
    reduce-scatter: a rank that skipped the forward pass would leave its peers waiting in a
    collective. Its loss is a sum over no tokens, 0 with a graph behind it, so its backward
    runs every collective and adds nothing to the gradient (zero-weight work).
    """
    if len(x.input_ids) == 0:
        one = torch.zeros((1, 1), dtype=torch.int64, device=x.input_ids.device)
        out = model(input_ids=one, attention_mask=torch.ones_like(one), position_ids=one,
                    use_cache=False).logits
        return out[:0, :0]
    return model(input_ids=x.input_ids, attention_mask=x.attention_mask,
                 position_ids=x.position_ids, use_cache=False).logits


def response_logprobs(model: torch.nn.Module, x: ModelInputs, temperature: float, *,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(n, T) log-probs of the response tokens (and (n, T) entropies if asked)."""
    logits = forward(model, x)
    # Only the positions that predict response tokens: (n, T, vocab), not (n, L, vocab).
    index = x.logit_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    picked = logits.gather(1, index)
    logp = logprobs_from_logits(picked, x.response_ids, temperature)
    entropy = entropy_from_logits(picked, temperature) if with_entropy else None
    return logp, entropy


def response_values(critic: torch.nn.Module, x: ModelInputs) -> torch.Tensor:
    """(n, T) values V(s_t) at the positions that predict each response token."""
    out = forward(critic, x).squeeze(-1).float()
    return out.gather(1, x.logit_index)


LossFn = Callable[[ModelInputs, Batch, torch.Tensor, ResultBuilder], torch.Tensor]
"""(inputs, micro-batch, per-token weights, builder) -> the micro-batch's weighted loss; the
inputs, the micro-batch and the weights are on the model's device."""


def train_shard(model: torch.nn.Module, optimizer: torch.optim.Optimizer, shard: Shard,
                builder: ResultBuilder, loss_fn: LossFn, *, pad_id: int, agg: str,
                totals: Totals, world_size: int, grad_clip: float, prefix: str) -> None:
    """One optimizer step on this rank's shard of a mini-batch (see the module docstring)."""
    optimizer.zero_grad(set_to_none=True)
    device = model_device(model)
    for mb in shard.micro_batches():
        with builder.span("forward_backward"):
            # The loss reads the micro-batch's columns (`padded`) where the model is.
            on_device = mb.to(device)
            x = model_inputs(on_device, pad_id)
            # A left-out sample's tokens weigh 0 (and `Totals` did not count them).
            mask = x.response_mask * sample_loss_mask(on_device)[:, None]
            # The WHOLE mini-batch's counts (`losses.token_weights`), so the sum over
            # micro-batches and ranks is the mini-batch's loss. FSDP averages gradients over
            # ranks: times world_size turns that average back into the sum.
            w = token_weights(mask, agg, tokens=totals.tokens, seqs=totals.seqs,
                              norm_len=totals.norm_len) * world_size
            loss = loss_fn(x, on_device, w, builder)
            loss.backward()
        # An update returns no columns, but the canonical result still accounts for every
        # sample it was sent (chapter 3), so the driver knows none was dropped.
        builder.add(mb.sample_ids)
        # Each rank's weighted loss is its share of the mini-batch loss times world_size.
        # A non-finite one is not recorded (metrics must be finite); the step is skipped below.
        value = float(loss.detach()) / world_size
        if math.isfinite(value):
            builder.metric(f"{prefix}/loss", value, "sum")
    with builder.span("optimizer"):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2: the same value everywhere
            norm = norm.full_tensor()
        # The global norm is the same on every rank (a NaN anywhere reaches it through the
        # gradient reduction), so every rank takes the same decision.
        if torch.isfinite(norm):
            builder.metric(f"{prefix}/grad_norm", float(norm), "max")
            optimizer.step()
            builder.metric(f"{prefix}/skipped_steps", 0.0, "sum")
        else:  # a NaN step would poison every weight: skip it, and count it in the metrics
            builder.metric(f"{prefix}/skipped_steps", 1.0 / world_size, "sum")
        optimizer.zero_grad(set_to_none=True)
