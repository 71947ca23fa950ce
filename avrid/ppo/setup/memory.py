"""Chapter 5 — the `memory` section of the config: how the trainer keeps its memory small.

`MemoryConfig` is one of `PPOConfig`'s sections (re-exported by `config.py`, where the others
are). Every field here trades memory against speed or float summation order, never against
the result: packed sequences, the attention kernel, the log-prob chunk and the offload of
parameters and optimizer state to host memory all compute the same numbers up to the order
of float sums (tests/test_ppo_packed_logprobs.py, tests/test_ppo_logprob_chunks.py), so a
resumed run may change any of them. Activation checkpointing, the other memory knob, is
`train.gradient_checkpointing` (it is older than this section; resumes may change it too).

`avrid ppo --estimate-memory` reads these fields to predict the peak of each phase.

Not here: the rules that tie this section to others (`validate.py`), what each choice does
(`columns.model_inputs`, `models.attention`, `algo.logprobs.chunked_logprobs`, `roles.fsdp`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from avrid.ppo.setup.validate import finite, need, one_of, positive

Attention = Literal["auto", "eager", "sdpa", "flash_attention_2"]
"""The attention kernel the trained models run (transformers' ``attn_implementation``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryConfig:
    """How the trainer's forward and backward passes hold their memory."""

    pack_sequences: bool = True
    """Run each micro-batch as ONE row of its real tokens (position ids restarting at 0 per
    sequence, attention block-diagonal) instead of right-padded rows: `train.micro_batch_tokens`
    is then what is computed. False = right-padded rows (n x the longest row's length). Both
    give the same numbers up to float summation order."""
    attention: Attention = "auto"
    """The trained models' attention kernel: "auto" = "flash_attention_2" on CUDA when the
    flash-attn package is installed and model.dtype is bfloat16 (its varlen kernel runs packed
    rows without a mask; it has no fp32, so "flash_attention_2" itself needs bfloat16), else
    "sdpa" (PyTorch's fused attention, which never stores the heads x L x L weights; on packed
    rows one sequence at a time, `engines/packed_attention.py`); "eager" = the explicit
    softmax(QK^T)V (on packed rows over an N x N block-diagonal mask: slow, for checks).
    The rollout engines keep their own kernels (the torch engine decodes with eager)."""
    logprob_chunk: int = 512
    """Response positions the output projection runs at once when computing log-probs and
    entropies: the (positions x vocabulary) fp32 logits exist for one chunk at a time, never
    for the whole micro-batch."""
    cpu_offload: bool = False
    """Keep the trained models' parameters, gradients and optimizer state in host memory
    between uses (FSDP2's CPUOffloadPolicy): each layer's weights come to the GPU for its
    forward and backward only, and the optimizer steps on the CPU. Much less GPU memory,
    much slower steps; for a model that does not fit otherwise."""

    def __post_init__(self) -> None:
        finite("memory", self)
        need(isinstance(self.pack_sequences, bool), "memory.pack_sequences",
             f"must be true or false, got {self.pack_sequences!r}")
        one_of("memory.attention", self.attention, Attention, "attention kernel")
        positive("memory", logprob_chunk=self.logprob_chunk)
        need(isinstance(self.cpu_offload, bool), "memory.cpu_offload",
             f"must be true or false, got {self.cpu_offload!r}")
