"""Chapter 6 — where a pipelined run's roles go: chapter 5's placement plus a rollout pool.

    policy   LearnerWorker   actor + reference, actor_dp ranks (no engine: chapter 5's
                             PolicyWorker without its rollout engine)
    critic   CriticWorker    as in chapter 5
    reward   RewardWorker    as in chapter 5
    rollout  RolloutWorker   pipeline.rollout_dp ranks (default: actor_dp), one bundle each —
                             CPUs, and a GPU of its own on CUDA — in a pool of their own

The rollout pool never shares a bundle with the trainer: generation must be able to run
while the trainer trains, which is the point of the chapter. This file only describes
placement (chapter 1's `RoleSpec`s); the backend starts it.
"""

from __future__ import annotations

from dataclasses import replace

from avrid.pipeline.learner import LearnerWorker
from avrid.pipeline.rollout import RolloutWorker
from avrid.ppo.driver.placement import placement_parts, tokenizer_kwargs
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.tokenizer import Tokenizer
from avrid.workers import Mesh, PlacementPlan, ResourcePool, RoleSpec, plan_placement


def pipeline_placement(config: PPOConfig, tokenizer: Tokenizer, *, max_response_tokens: int,
                       learner: type[LearnerWorker] = LearnerWorker,
                       rollout: type[RolloutWorker] = RolloutWorker) -> PlacementPlan:
    """The pools and roles of a one_step_off or async run (see the module docstring);
    `learner` and `rollout` may be subclasses (the tests inject failures that way)."""
    pools, roles = placement_parts(config, tokenizer, max_response_tokens=max_response_tokens)
    roles = [replace(r, worker=learner) if r.role == "policy" else r for r in roles]
    p = config.placement
    n = config.pipeline.rollout_dp or p.actor_dp
    gpus = 1.0 if p.device == "cuda" else 0.0
    pools.append(ResourcePool.uniform("rollout", n, cpus=p.cpus_per_worker, gpus=gpus,
                                      strategy=p.strategy))
    roles.append(RoleSpec(role="rollout", worker=rollout, mesh=Mesh.of(dp=n),
                          pool="rollout", cpus=p.cpus_per_worker, gpus=gpus,
                          init_kwargs={"config": config, "eos_id": tokenizer.eos_token_id,
                                       "stop_ids": tuple(tokenizer.stop_token_ids),
                                       "max_response_tokens": max_response_tokens,
                                       **tokenizer_kwargs(tokenizer)}))
    return plan_placement(pools, roles)
