"""Chapter 5 — where each role runs: the placement of a PPO/GRPO run, from its config.

Roles and their workers:

    policy   PolicyWorker   actor + reference + rollout (the hybrid engine), actor_dp ranks
    critic   CriticWorker   PPO only, critic_dp ranks
    reward   RewardWorker   one rank: verifiable rewards are cheap

The pool "policy" has one bundle per policy rank (CPUs, and one GPU each on CUDA). The critic
shares those bundles (colocated, each worker taking a share) or, with
``placement.colocate_critic=False``, gets a pool of its own. The reward worker sits in the
first policy bundle with a small CPU share, since it runs while the policy waits.
``placement.strategy`` lays the bundles over a cluster's nodes (STRICT_SPREAD: one node each).
This file only describes placement (chapter 1's `RoleSpec`s); the backend starts it.
`critic_after_engine` says whether a colocated critic sets up after the policy's engine.
"""

from __future__ import annotations

from avrid.ppo.roles.critic import CriticWorker
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.roles.reward import RewardWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.tokenizer import Tokenizer
from avrid.workers import Mesh, PlacementPlan, ResourcePool, RoleSpec, plan_placement

REWARD_CPU_SHARE = 0.1
"""CPU slots the reward worker reserves inside the first policy bundle."""


def build_placement(config: PPOConfig, tokenizer: Tokenizer, *,
                    max_response_tokens: int) -> PlacementPlan:
    """The pools and role specs of this run (validated by chapter 1's `plan_placement`).
    `max_response_tokens` is the run's one response budget (the trainer resolves it)."""
    return plan_placement(*placement_parts(config, tokenizer,
                                           max_response_tokens=max_response_tokens))


def placement_parts(config: PPOConfig, tokenizer: Tokenizer, *,
                    max_response_tokens: int) -> tuple[list[ResourcePool], list[RoleSpec]]:
    """`build_placement`'s pools and role specs before they are checked and laid out, for a
    layer that adds to them (chapter 6 adds a rollout pool)."""
    p = config.placement
    gpus = 1.0 if p.device == "cuda" else 0.0
    share = 2 if config.algo.uses_critic and p.colocate_critic else 1
    policy_pool = ResourcePool.uniform("policy", p.actor_dp, cpus=p.cpus_per_worker, gpus=gpus,
                                       strategy=p.strategy)
    pools = [policy_pool]
    tok = tokenizer_kwargs(tokenizer)
    # Colocated roles split each bundle (CPUs and GPU); the policy leaves room for the reward.
    cpus = p.cpus_per_worker / share - REWARD_CPU_SHARE
    roles = [RoleSpec(role="policy", worker=PolicyWorker, mesh=Mesh.of(dp=p.actor_dp),
                      pool="policy", cpus=cpus,
                      gpus=gpus / share,
                      init_kwargs={"config": config, "eos_id": tokenizer.eos_token_id,
                                   "stop_ids": tuple(tokenizer.stop_token_ids),
                                   "max_response_tokens": max_response_tokens, **tok})]
    if config.algo.uses_critic:
        critic_pool = "policy"
        if not p.colocate_critic:
            pools.append(ResourcePool.uniform("critic", p.critic_dp, cpus=p.cpus_per_worker,
                                              gpus=gpus, strategy=p.strategy))
            critic_pool = "critic"
        roles.append(RoleSpec(role="critic", worker=CriticWorker, mesh=Mesh.of(dp=p.critic_dp),
                              pool=critic_pool, cpus=p.cpus_per_worker / share,
                              gpus=gpus / share if p.colocate_critic else gpus,
                              init_kwargs={"config": config, **tok}))
    roles.append(RoleSpec(role="reward", worker=RewardWorker, mesh=Mesh.of(dp=1),
                          pool="policy", cpus=REWARD_CPU_SHARE,
                          init_kwargs={"task_name": config.task.name,
                                       "task_options": config.task.kwargs,
                                       "task_path": config.task.path, "tokenizer": tokenizer,
                                       "rewards": dict(config.task.reward_weights)}))
    return pools, roles


def critic_after_engine(config: PPOConfig) -> bool:
    """Whether the critic's setup must wait for the policy's (the trainer's `start`).

    Yes when the critic shares the policy's GPUs (colocated, CUDA) and the policy's setup
    starts a vLLM engine: vLLM sizes its KV cache from the GPU memory it finds free while it
    profiles, so a critic loading at that moment would either be counted as vLLM's or take
    memory vLLM already counted on. Otherwise both set up at once (the torch engine sizes
    nothing; a CPU run must not wait; a critic pool of its own shares no GPU; a
    disaggregated pipeline's policy has no engine).

    Example:
        >>> from avrid.ppo.setup.presets import preset
        >>> critic_after_engine(preset("tiny-ppo"))  # CPU, torch engine
        False
    """
    p = config.placement
    return (config.algo.uses_critic and p.colocate_critic and p.device == "cuda"
            and config.rollout.engine == "vllm" and not config.pipeline.disaggregated)


def tokenizer_kwargs(tokenizer: Tokenizer) -> dict[str, int]:
    """What a model-holding worker needs to know of the tokenizer: vocabulary and pad id."""
    return {"vocab_size": int(tokenizer.vocab_size), "pad_id": tokenizer.pad_token_id}
