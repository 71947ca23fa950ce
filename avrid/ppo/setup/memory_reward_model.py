"""Chapter 5 — a learned reward model's memory (``--estimate-memory`` with `reward_model.path`).

The reward model (`roles/reward_model.py`) holds its whole weights on every one of its ranks,
in its dtype (bf16 on a GPU unless `reward_model.dtype` says otherwise), for the whole run:
nothing offloads it between steps. Its phase adds one padded forward of
`reward_model.micro_batch_tokens` tokens, without gradients. Which GPU holds it follows
`reward_model.placement`:

    critic   the critic's GPU (the policy's when the critic is colocated)
    pool     a GPU kind of its own, "reward_model", `reward_model.dp` of them
    policy   the policy's GPU

`memory_estimate.estimate` adds its weights (component "rm") to every phase of that GPU and
its own phase, "reward model". This file only sizes; the shape comes from the checkpoint's
config.json (`memory_shapes.shape_from_path`), nothing is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.memory_activations import Workload, forward_bytes
from avrid.ppo.setup.memory_shapes import ModelShape, shape_from_path


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardModelMemory:
    """Where the reward model sits and what it takes there."""

    gpu: str
    """The GPU kind that holds it: "policy", "critic" or "reward_model"."""
    shape: ModelShape
    weights: int
    """Bytes of its weights on each of its ranks."""
    activations: int
    """Bytes of one forward's activations (a full micro-batch)."""


def reward_model_gpu(config: PPOConfig) -> str:
    """The GPU kind the reward model's ranks share (see the module docstring)."""
    rm, p = config.reward_model, config.placement
    if rm.placement == "pool":
        return "reward_model"
    if rm.placement == "critic" and not p.colocate_critic:
        return "critic"
    return "policy"


def reward_model_memory(config: PPOConfig, longest: int) -> RewardModelMemory | None:
    """The reward model's bytes on its GPU (None without one); `longest`: the longest
    sequence a step makes (prompt cap + response budget), the padded row's length."""
    rm = config.reward_model
    if not rm.enabled:
        return None
    shape = shape_from_path(rm.path)
    cd = 2 if rm.torch_dtype(config.placement.device) == "bfloat16" else 4
    # The trunk and a one-output score head, as the critic's (no LM head).
    weights = cd * shape.critic_params
    # A padded forward of at most micro_batch_tokens tokens: rows of the longest length.
    row = min(longest, rm.micro_batch_tokens)
    rows = max(1, rm.micro_batch_tokens // row)
    w = Workload(rows=rows, tokens=rows * row, longest=row, response_tokens=0, gen_rows=0,
                 gen_len=row)
    activ = forward_bytes(shape, w, config, cd, grad=False, checkpointing=False,
                          kernel="sdpa", logits=0)
    return RewardModelMemory(gpu=reward_model_gpu(config), shape=shape, weights=weights,
                             activations=activ)
