"""Chapter 5 — where each role runs: the placement of a PPO/GRPO run, from its config.

Roles and their workers:

    policy   PolicyWorker   actor + reference + rollout (the hybrid engine), actor_dp ranks
    reference ReferenceWorker with placement.reference="pool" only: reference_dp bundles of
                             its own (the policy then holds no reference)
    critic   CriticWorker   PPO only, critic_dp ranks
    reward        RewardWorker       one rank: verifiable rewards are cheap; where
                                     placement.reward says: "policy" a 0.1-CPU share of the
                                     first policy bundle, "critic" the same share of the
                                     first critic bundle, "pool" one bundle of its own
    reward_model  RewardModelWorker  with reward_model.path only; where reward_model.placement
                                     says: "critic" (NeMo-Aligner) one rank per critic bundle,
                                     "pool" (OpenRLHF) reward_model.dp bundles of its own,
                                     "policy" (DeepSpeed-Chat) one rank per policy bundle

The pool "policy" has one bundle per policy rank (CPUs, and one GPU each on CUDA). The critic
shares those bundles (colocated, each worker taking a share) or, with
``placement.colocate_critic=False``, gets a pool of its own. The reward worker sits by
default in the first policy bundle with a small CPU share, since it runs while the policy
waits (serially; `train.concurrent_phases` runs it beside the policy's log-probs, hence
`placement.reward`). Roles that share a bundle split its CPUs and GPU equally (`_shares`),
less the reward's share where it sits. The seed's three layouts, as configs:
`chapters/ch05_ppo/configs/layout_*.yaml`.
``placement.strategy`` lays the bundles over a cluster's nodes (STRICT_SPREAD: one node each).
This file only describes placement (chapter 1's `RoleSpec`s); the backend starts it.
`critic_after_engine` says whether a colocated critic sets up after the policy's engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from avrid.ppo.roles.critic import CriticWorker
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.roles.reference import ReferenceWorker
from avrid.ppo.roles.reward import RewardWorker
from avrid.ppo.roles.reward_model import RewardModelWorker
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
    share, critic_share = _shares(config)
    policy_pool = ResourcePool.uniform("policy", p.actor_dp, cpus=p.cpus_per_worker, gpus=gpus,
                                       strategy=p.strategy)
    pools = [policy_pool]
    tok = tokenizer_kwargs(tokenizer)
    # Colocated roles split each bundle (CPUs and GPU); the role whose first bundle holds
    # the reward leaves room for it (on a pool of its own it takes a whole bundle).
    reward_pool, reward_cpus = _reward_place(config)
    room = REWARD_CPU_SHARE if p.reward != "pool" else 0.0
    cpus = p.cpus_per_worker / share - (room if p.reward == "policy" else 0.0)
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
                              pool=critic_pool,
                              cpus=p.cpus_per_worker / critic_share
                              - (room if p.reward == "critic" else 0.0),
                              gpus=gpus / critic_share,
                              init_kwargs={"config": config, **tok}))
    if p.reference == "pool":  # a whole frozen copy per rank, nothing else on its bundles
        pools.append(ResourcePool.uniform("reference", p.reference_dp, cpus=p.cpus_per_worker,
                                          gpus=gpus, strategy=p.strategy))
        roles.append(RoleSpec(role="reference", worker=ReferenceWorker,
                              mesh=Mesh.of(dp=p.reference_dp), pool="reference",
                              cpus=p.cpus_per_worker, gpus=gpus,
                              init_kwargs={"config": config,
                                           "eos_id": tokenizer.eos_token_id, **tok}))
    if reward_pool == "reward":
        pools.append(ResourcePool.uniform("reward", 1, cpus=reward_cpus, gpus=0.0,
                                          strategy=p.strategy))
    reward = RoleSpec(role="reward", worker=RewardWorker, mesh=Mesh.of(dp=1),
                      pool=reward_pool, cpus=reward_cpus,
                      init_kwargs={"task_name": config.task.name,
                                   "task_options": config.task.kwargs,
                                   "task_path": config.task.path, "tokenizer": tokenizer,
                                   "rewards": dict(config.task.reward_weights)})
    roles.append(reward)
    rm = config.reward_model
    if rm.enabled:
        # Its ranks read rows as the rule reward does: the same task and policy tokenizer;
        # the path made absolute here, where the user's directory is the current one.
        rm = dataclasses.replace(rm, path=str(Path(rm.path).resolve()))
        kwargs = {"config": rm, "device": p.device, "reader": dict(reward.init_kwargs)}
        if rm.placement == "pool":
            pools.append(ResourcePool.uniform("reward_model", rm.dp, cpus=p.cpus_per_worker,
                                              gpus=gpus, strategy=p.strategy))
            where, n, rm_share = "reward_model", rm.dp, 1
        elif rm.placement == "critic":
            where, n, rm_share = ("policy" if p.colocate_critic else "critic", p.critic_dp,
                                  critic_share)
        else:
            where, n, rm_share = "policy", p.actor_dp, share
        roles.append(RoleSpec(role="reward_model", worker=RewardModelWorker,
                               mesh=Mesh.of(dp=n), pool=where, cpus=p.cpus_per_worker / rm_share,
                               gpus=gpus / rm_share, init_kwargs=kwargs))
    return pools, roles


def _reward_place(config: PPOConfig) -> tuple[str, float]:
    """The pool of the rule reward's one rank (its rank 0 lands in the pool's first bundle)
    and the CPUs it reserves there (`placement.reward`)."""
    p = config.placement
    if p.reward == "pool":
        return "reward", p.cpus_per_worker
    if p.reward == "critic" and not p.colocate_critic:
        return "critic", REWARD_CPU_SHARE
    return "policy", REWARD_CPU_SHARE  # "policy", or "critic" on the policy's bundles


def _shares(config: PPOConfig) -> tuple[int, int]:
    """How many roles split each policy bundle, and each critic bundle (the policy's when
    the critic is colocated): the policy, a colocated critic, a reward model placed there."""
    p, rm = config.placement, config.reward_model
    critic = config.algo.uses_critic
    with_critic = rm.enabled and rm.placement == "critic"
    rm_on_policy = rm.enabled and (rm.placement == "policy"
                                   or (with_critic and p.colocate_critic))
    share = 1 + (critic and p.colocate_critic) + rm_on_policy
    return share, (share if p.colocate_critic else 1 + with_critic)


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
