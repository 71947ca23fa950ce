"""Chapter 5 — the actor's and critic's compute on one micro-batch, and the training walk.

What a policy or critic worker does with a shard, as functions of (model, micro-batch):

- `response_logprobs`: one forward over the micro-batch (`columns.model_inputs`), then
  the log-prob of every response token (and its entropy), the output projection run over the
  response positions only, in chunks (`logprobs.chunked_logprobs`) — the "old log-probs",
  the reference log-probs and, with grad, the log-probs inside the PPO loss;
- `shard_logprobs`: that forward, without grad, over every micro-batch of a shard, into a
  result (the actor's "old_logp" and the reference's "ref_logp", wherever it runs);
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

The losses themselves are in `losses.py`; the workers that call this are `roles/policy.py`,
`roles/critic.py` and `roles/reference.py`. Nothing here talks to Ray or knows which rank it is.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers.utils import ModelOutput

from avrid.dispatch import Batch, Shard
from avrid.ppo.algo.logprobs import chunked_logprobs
from avrid.ppo.algo.losses import token_weights
from avrid.ppo.data.columns import ModelInputs, Totals, model_inputs, sample_loss_mask
from avrid.ppo.engines.packed_attention import varlen_kwargs
from avrid.results import ResultBuilder


def model_device(model: torch.nn.Module) -> torch.device:
    """Where `model` computes: the device of its parameters. Under FSDP2 they are DTensors,
    whose `.device` is this rank's local device — except under CPU offload, where the
    shards sit in host memory and the mesh's device computes; a dp = 1 fp32 actor or critic
    is a plain module."""
    p = next(model.parameters())
    mesh = getattr(p, "device_mesh", None)
    if mesh is None or mesh.device_type == p.device.type:
        return p.device
    return torch.device(mesh.device_type,
                        torch.get_device_module(mesh.device_type).current_device())


LOGPROB_CHUNK = 512
"""Response positions per chunk of `chunked_logprobs`: the trainer holds (this x vocab)
logits at a time (fp32: 0.3 GB at Qwen2.5's 152k vocabulary), never (tokens x vocab)."""


def forward(model: torch.nn.Module, x: ModelInputs) -> torch.Tensor:
    """The model's (n, L, out) output, one right-padded row per sequence (L = the longest;
    the padding's entries mean nothing), whichever layout `x` has: a packed row is cut back
    into its sequences. For checks and tests: training never asks for a vocabulary-wide
    output of every token (`response_logprobs`, `response_values`).
    """
    out = run_model(model, x).logits
    if x.input_ids.shape[-1] == 0:  # the one-token stand-in of `run_model`: zero rows of it
        return out[:0, :0]
    if len(out) == len(x.logit_index):  # already one row per sequence
        return out
    positions = x.position_ids[0]
    row = torch.cumsum(positions == 0, 0) - 1  # each sequence starts at position 0
    rows = torch.zeros((len(x.logit_index), int(positions.max()) + 1, out.shape[-1]),
                       dtype=out.dtype, device=out.device)
    return rows.index_put((row, positions), out[0])


def run_model(model: torch.nn.Module, x: ModelInputs, **kwargs) -> ModelOutput:
    """The model's output for a micro-batch (packed: one row, no attention mask); `kwargs`
    go to the model (e.g. ``output_hidden_states``).

    An empty micro-batch (a rank whose shard is smaller than its peers', or empty) still runs
    the model, on one token, and its callers cut zero rows from that output
    (`_at_responses`). Under FSDP every rank must take part in each layer's all-gather, and
    in training in its gradient reduce-scatter: a rank that skipped the forward pass would
    leave its peers waiting in a collective. Its loss is a sum over no tokens, 0 with a graph
    behind it, so its backward runs every collective and adds nothing to the gradient
    (zero-weight work).
    """
    if x.input_ids.shape[-1] == 0:
        one = torch.zeros((1, 1), dtype=torch.int64, device=x.input_ids.device)
        return model(input_ids=one, position_ids=one, use_cache=False, **kwargs)
    # A mask without padding says nothing: left out, transformers reads packed sequences
    # from the position ids restarting at 0 (`masking_utils.find_packed_sequence_indices`)
    # and masks attention block-diagonally (eager/sdpa; flash-attn 2's varlen kernel when
    # the model was loaded with attn_implementation="flash_attention_2").
    mask = None if bool(x.attention_mask.all()) else x.attention_mask
    if x.cu_seqlens is not None and mask is None:
        # The packed row's boundaries, made once: every layer's kernel (flash-attn's varlen
        # path, `packed_attention`'s) takes them instead of syncing on the position ids.
        kwargs = {**varlen_kwargs(x.cu_seqlens, x.longest), **kwargs}
    return model(input_ids=x.input_ids, attention_mask=mask, position_ids=x.position_ids,
                 use_cache=False, **kwargs)


def _at_responses(out: torch.Tensor, x: ModelInputs) -> torch.Tensor:
    """(n, T, ...) entries of a per-token model output (batch, L, ...) at `x.logit_index`."""
    if x.input_ids.shape[-1] == 0:  # the one-token stand-in of `run_model`: zero rows of it
        return out[:0, :0]
    if len(out) == 1:  # one packed row (or a single padded one): indices into that row
        return out[0][x.logit_index]
    rows = torch.arange(len(x.logit_index), device=out.device)[:, None]
    return out[rows, x.logit_index]


def response_logprobs(model: torch.nn.Module, x: ModelInputs, temperature: float, *,
                      with_entropy: bool = False,
                      chunk: int = LOGPROB_CHUNK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(n, T) log-probs of the response tokens (and (n, T) entropies if asked; 0 on padding).

    The model runs once as a whole (its own ``__call__``, so FSDP2's hooks gather and free
    its weights as usual) and returns its final hidden states; its logits are asked for one
    position only (``logits_to_keep=1``). The output projection then runs over the response
    positions only, `chunk` at a time (`chunked_logprobs`), as the module the model holds
    (``get_output_embeddings()``; tied to the embedding for Qwen2.5-0.5B, used as it is).
    FSDP2 does not reshard its root module after a forward, so that projection's weight is
    the gathered one until backward, where the root's gradient reduction happens last.
    """
    with _quiet_fsdp_view_warning(model):
        out = run_model(model, x, output_hidden_states=True, logits_to_keep=1)
    # The last entry is the final norm's output (transformers ties it to last_hidden_state).
    hidden = _at_responses(out.hidden_states[-1], x)
    valid = x.response_mask.bool()
    head = model.get_output_embeddings()
    if valid.any():
        logp, ent = chunked_logprobs(hidden[valid], head, x.response_ids[valid], temperature,
                                     chunk=chunk, with_entropy=with_entropy)
    else:
        # Still through the head, on one position cut to none: under FSDP every rank's
        # backward must reach the same parameters (a gradient of zeros here).
        stand_in = out.hidden_states[-1][0, :1]
        zero = torch.zeros(1, dtype=torch.int64, device=stand_in.device)
        logp, ent = chunked_logprobs(stand_in, head, zero, temperature, chunk=chunk,
                                     with_entropy=with_entropy)
        logp, ent = logp[:0], (ent[:0] if ent is not None else None)
    return _unpacked(logp, valid), (_unpacked(ent, valid) if ent is not None else None)


def shard_logprobs(model: torch.nn.Module, shard: Shard, builder: ResultBuilder, *,
                   column: str, pad_id: int, temperature: float, packed: bool, chunk: int,
                   with_entropy: bool) -> None:
    """Log-probs of every response token of `shard` under `model`, without grad, into
    `builder` as the packed `column`; `with_entropy`: the ``actor/entropy`` metric too,
    computed chunk by chunk with the log-probs (no (tokens x vocab) tensor)."""
    device = model_device(model)  # the builder keeps CPU copies of what it is given
    with torch.no_grad():
        for mb in shard.micro_batches():
            with builder.span(column):
                x = model_inputs(mb.to(device), pad_id, packed=packed)
                logp, ent = response_logprobs(model, x, temperature, with_entropy=with_entropy,
                                              chunk=chunk)
            builder.add_padded(mb.sample_ids, mb.response_lens, padded={column: logp})
            if ent is not None:
                builder.metric("actor/entropy", ent[x.action_mask.bool()], "mean_tokens")


@contextmanager
def _quiet_fsdp_view_warning(model: torch.nn.Module) -> Iterator[None]:
    """Silence FSDP2's "returned a view tensor" warning for this call only, on an FSDP2 model.

    With ``output_hidden_states`` the model also returns the embedding's output, which FSDP2
    hands over as a view; its warning is about in-place ops on such outputs, and nothing here
    writes to any of them (the hidden states are only indexed). A plain module (dp = 1 fp32,
    the reference) warns nothing and changes no warning filter.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
        yield


def _unpacked(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(R,) values of the valid positions -> (n, T), 0 elsewhere (keeps the graph)."""
    full = torch.zeros(valid.shape, dtype=values.dtype, device=values.device)
    return full.index_put((valid,), values)


def response_values(critic: torch.nn.Module, x: ModelInputs) -> torch.Tensor:
    """(n, T) values V(s_t) at the positions that predict each response token."""
    out = run_model(critic, x).logits.squeeze(-1).float()
    return _at_responses(out, x)


LossFn = Callable[[ModelInputs, Batch, torch.Tensor, ResultBuilder], torch.Tensor]
"""(inputs, micro-batch, per-token weights, builder) -> the micro-batch's weighted loss; the
inputs, the micro-batch and the weights are on the model's device."""


def train_shard(model: torch.nn.Module, optimizer: torch.optim.Optimizer, shard: Shard,
                builder: ResultBuilder, loss_fn: LossFn, *, pad_id: int, agg: str,
                packed: bool = True,
                totals: Totals, world_size: int, grad_clip: float, prefix: str) -> None:
    """One optimizer step on this rank's shard of a mini-batch (see the module docstring)."""
    optimizer.zero_grad(set_to_none=True)
    device = model_device(model)
    for mb in shard.micro_batches():
        with builder.span("forward_backward"):
            # The loss reads the micro-batch's columns (`padded`) where the model is.
            on_device = mb.to(device)
            x = model_inputs(on_device, pad_id, packed=packed)
            # A left-out sample's tokens weigh 0 (and `Totals` did not count them), and so
            # do observation tokens (`columns.action_mask`: chapter 7's multi-turn responses).
            mask = x.action_mask * sample_loss_mask(on_device)[:, None]
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
