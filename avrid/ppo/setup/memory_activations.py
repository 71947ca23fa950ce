"""Chapter 5 — the micro-batch a config allows, and the activations and logits it holds.

`memory_estimate.estimate` adds up a phase's bytes by component; this file computes the two
that depend on the batch rather than on the model's state:

    activ    saved activations: per decoder layer per token (`ACT_*`), or with
             train.gradient_checkpointing each layer's input plus one layer recomputed; no grad:
             the hidden states every layer returns (output_hidden_states) and one layer's work;
             plus the attention mask / scores of the attention kernel (`forward_bytes`)
    logits   `memory.logprob_chunk` positions x vocab, a few fp32 copies (`LOGIT_COPIES_*`:
             chunked_logprobs), never tokens x vocab (`logit_bytes`)

The micro-batch is the worst one the config allows (`workload_of`): packed, its
`train.micro_batch_tokens` real tokens; padded, n rows of the longest sequence (n: the budget
over half the longest). A benchmark that knows its batch passes its own `Workload`.

The per-token coefficients were counted from the Qwen2 layer's saved tensors and checked on
CPU (benchmarks/memory_estimate.py: three configs within 20% of the measured peak).

Not here: the model's state, the engine, the sync and the setup (`memory_estimate.py`), shapes
(`memory_shapes.py`).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.memory_shapes import ModelShape

TORCH_ENGINE_BATCH = 256
"""`TorchEngine`'s prompts per generate batch (its `batch_size` default)."""
DEFAULT_MAX_RESPONSE = 256
"""The response budget assumed when `rollout.max_response_tokens` is None (the task's hint
is not read: reading a task may need its data file)."""
ACT_H, ACT_KV, ACT_I = 9, 6, 4
"""Saved activations of one decoder layer, per token, in units of (width x compute dtype):
two RMSNorms (input, normalised: 2H each), q, k, v and their rotary halves, the attention
output and o_proj's input (~9 H + 6 kv), the MLP's gate, SiLU, up and product (4 I)."""
RECOMPUTE_H, RECOMPUTE_I = 2, 2
"""Backward's transient gradients of one layer's activations (H- and I-wide), on top of
what it saved: with checkpointing, the recomputed layer's working set."""
NOGRAD_H, NOGRAD_I = 4, 2
"""A no-grad forward's working set inside one layer (the MLP's gate and up alive at once)."""
LOGIT_COPIES_FWD, LOGIT_COPIES_ENTROPY, LOGIT_COPIES_BWD = 3, 1, 4
"""fp32 (chunk x vocab) copies alive in `chunked_logprobs`: logits, scaled, the logsumexp
temporary; +2 with the entropy (log_softmax, its exp); backward's recomputation + gradients."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """The sizes of the largest micro-batch and generate batch one rank runs."""

    rows: int
    """Sequences in the micro-batch."""
    tokens: int
    """Tokens its forward computes (packed: the real ones; padded: rows x longest)."""
    longest: int
    """Its longest sequence (a padded row's length; attention's L)."""
    response_tokens: int
    """Response positions in it (where log-probs are taken)."""
    gen_rows: int
    """Prompts one generate call of one rank's engine holds."""
    gen_len: int
    """Prompt + response budget of a generated sequence."""


def response_budget(config: PPOConfig) -> int:
    """`rollout.max_response_tokens`, or `DEFAULT_MAX_RESPONSE` where it is None."""
    return config.rollout.max_response_tokens or DEFAULT_MAX_RESPONSE


def workload_of(config: PPOConfig) -> Workload:
    """The worst micro-batch and generate batch `config` lets one actor rank run."""
    t, dp = config.train, config.placement.actor_dp
    response = response_budget(config)
    seq = config.rollout.max_prompt_tokens + response
    step_seqs = t.prompts_per_step * config.algo.responses_per_prompt
    rank_seqs = max(1, math.ceil(min(t.mini_batch_size, step_seqs) / dp))
    if config.memory.pack_sequences:  # the real tokens; rows of half the longest on average
        tokens = min(t.micro_batch_tokens, rank_seqs * seq)
        rows = max(1, min(rank_seqs, tokens // max(1, seq // 2)))
        resp = max(1, tokens * response // seq)
    else:  # right-padded: n rows of the longest, n = the budget over a half-length sequence
        rows = max(1, min(rank_seqs, t.micro_batch_tokens // max(1, seq // 2)))
        tokens, resp = rows * seq, rows * response
    gen_seqs = max(1, math.ceil(step_seqs / dp))
    gen_rows = gen_seqs if config.rollout.engine == "vllm" else min(TORCH_ENGINE_BATCH,
                                                                     gen_seqs)
    return Workload(rows=rows, tokens=tokens, longest=min(seq, tokens), response_tokens=resp,
                    gen_rows=gen_rows, gen_len=seq)


PACKED_SDPA = "packed sdpa"
"""SDPA one sequence at a time over a packed row (`engines.packed_attention`)."""


def attention_kernel(config: PPOConfig) -> str:
    """The trained models' kernel, as `models.trainer_attention` picks it (without importing
    torch): flash-attn 2 for "auto" on CUDA where installed, in bf16 (flash-attn has no
    fp32); SDPA ("auto" or "sdpa") over packed rows is the per-sequence kernel; otherwise the
    choice itself."""
    choice, device = config.memory.attention, config.placement.device
    if (choice == "auto" and device == "cuda" and config.model.dtype == "bfloat16"
            and importlib.util.find_spec("flash_attn")):
        return "flash_attention_2"
    if choice in ("auto", "sdpa"):
        return PACKED_SDPA if config.memory.pack_sequences else "sdpa"
    return choice


def _attention_bytes(shape: ModelShape, w: Workload, kernel: str, cd: int, packed: bool, *,
                     grad: bool, layers_saved: int) -> int:
    """What attention adds beyond the per-token activations (`ACT_*` count q, k, v and the
    output once per token): the per-sequence kernel's (rows, heads, longest, dim) copies of
    q, k, v (GQA-expanded) and output; the mask of SDPA over padded rows; eager's score
    matrices (heads x L x L per row, saved by every layer that keeps activations)."""
    if kernel == "flash_attention_2":
        return 0
    slots = w.rows * w.longest  # the (rows x longest) grid a padded or gathered layout fills
    if kernel == PACKED_SDPA:
        extra = cd * max(0, 4 * slots * shape.hidden
                         - w.tokens * (2 * shape.hidden + 2 * shape.kv_width))
        return extra * (layers_saved if grad else 1)
    squares = w.tokens * w.tokens if packed else w.rows * w.longest * w.longest
    if kernel == "sdpa":
        return 4 * squares  # one float mask (measured: ~4 bytes per entry on CPU)
    per_layer = shape.heads * squares * 4  # softmax in fp32
    return per_layer * ((layers_saved if grad else 0) + 2)


def _layer_activation_bytes(shape: ModelShape, tokens: int, cd: int) -> int:
    return tokens * cd * (ACT_H * shape.hidden + ACT_KV * shape.kv_width
                          + ACT_I * shape.intermediate)


def forward_bytes(shape: ModelShape, w: Workload, config: PPOConfig, cd: int, *,
                   grad: bool, checkpointing: bool, kernel: str, logits: int) -> int:
    """Activations of one micro-batch's forward (and backward, with `grad`), beyond the
    `logits` bytes of the head: the layers' transient working set and the head's logits never
    coexist (the head runs after the last layer, its backward before the first layer's), so
    only what the larger of the two exceeds the logits by is counted here."""
    h, i, n, layers = shape.hidden, shape.intermediate, w.tokens, shape.layers
    packed = config.memory.pack_sequences
    hidden_rows = w.response_tokens * h * cd * (2 if grad else 1)  # gathered for the head
    if not grad:
        kept = (layers + 1) * n * h * cd  # output_hidden_states: every layer's output
        work = n * cd * (NOGRAD_H * h + NOGRAD_I * i) + _attention_bytes(
            shape, w, kernel, cd, packed, grad=False, layers_saved=0)
        return kept + hidden_rows + max(0, work - logits)
    backward = n * cd * (RECOMPUTE_H * h + RECOMPUTE_I * i)
    if checkpointing:  # each layer's input; one layer recomputed at a time in backward
        saved = (layers + 1) * n * h * cd
        backward += _layer_activation_bytes(shape, n, cd) + _attention_bytes(
            shape, w, kernel, cd, packed, grad=True, layers_saved=1)
    else:
        saved = layers * _layer_activation_bytes(shape, n, cd) + n * h * cd + _attention_bytes(
            shape, w, kernel, cd, packed, grad=True, layers_saved=layers)
    return saved + hidden_rows + max(0, backward - logits)


def logit_bytes(shape: ModelShape, w: Workload, chunk: int, *, grad: bool,
                 entropy: bool) -> int:
    rows = max(1, min(chunk, w.response_tokens))
    copies = LOGIT_COPIES_BWD if grad else LOGIT_COPIES_FWD
    copies += LOGIT_COPIES_ENTROPY if entropy else 0
    return rows * shape.vocab * 4 * copies
