"""Chapter 7 — episodes in chapter 6's pipeline: a rollout pool that runs multi-turn episodes
while the trainer learns.

Chapter 6 moved generation into a pool of its own and let it run up to K weight versions
ahead (`pipeline.mode=one_step_off` or `async`). Episodes need only the rollout worker's
`generate` replaced — the pool, the pushes, the staleness gate and the off-policy correction
stay chapter 6's:

- `AgentRolloutWorker`: the rollout worker whose `generate` runs episodes
  (`worker.agent_shard`), each sample stamped with the "version" its engine holds and each
  policy token with it too ("token_version");
- `AgentPipelinedTrainer`: chapter 6's trainer with chapter 7's steps (`EpisodeSteps`: no
  reward call, episode metrics, validation on episodes).

A push waits for the generation in flight, as in chapter 6: a batch's tokens all come from
the version it was launched with, so K = 0 is the synchronous run exactly. The episode loop
can already take new weights between two engine calls (`episodes.WeightSource`: partial
rollouts, each token stamped with its version); letting a push land mid-generation is the
step after this one.

Not here: the pipeline itself (`avrid.pipeline`), the episode loop (`episodes.py`).
"""

from __future__ import annotations

from typing import Any

from avrid.agents.episodes import FixedVersion
from avrid.agents.trainer import EpisodeSteps, check_agent_task
from avrid.agents.worker import agent_shard, agent_task, episode_limits
from avrid.dispatch import Shard
from avrid.pipeline import PipelinedTrainer
from avrid.pipeline.rollout import RolloutWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.tokenizer import make_tokenizer
from avrid.results import WorkerResult
from avrid.workers import WorkerIdentity


class AgentRolloutWorker(RolloutWorker):
    """Chapter 6's rollout rank whose `generate` runs multi-turn episodes."""

    def __init__(self, identity: WorkerIdentity, **kwargs: Any) -> None:
        super().__init__(identity, **kwargs)
        self.task = agent_task(self.config)
        self.tokenizer = make_tokenizer(self.config, self.task)
        self.limits = episode_limits(self.task, self.max_response)

    def generate(self, shard: Shard, *, max_new_tokens: int, greedy: bool,
                 seed: int) -> WorkerResult:
        """One episode per prompt of the shard, every sample and policy token stamped with
        the weight version the engine holds."""
        if self.version is None:
            raise RuntimeError(f"{self.identity.name}: no weights received yet; the driver "
                               f"pushes them before the first generation")
        return agent_shard(self.engine, shard, self.identity, task=self.task,
                           tokenizer=self.tokenizer, limits=self.limits, config=self.config,
                           stop_ids=self.stop_ids, greedy=greedy, seed=seed,
                           schedule=self.config.rollout.agent_schedule,
                           weights=FixedVersion(self.version),
                           scalars={"version": self.version})


class AgentPipelinedTrainer(EpisodeSteps, PipelinedTrainer):
    """Chapter 6's pipelined trainer over multi-turn episodes (see the module docstring)."""

    rollout_worker = AgentRolloutWorker

    def __init__(self, config: PPOConfig) -> None:
        super().__init__(config)
        check_agent_task(self.task, config)

    def validate(self) -> dict[str, float]:
        """Episodes on the held-out prompts by the rollout pool, brought to the trainer's
        weights first (`PipelinedTrainer.catch_up`)."""
        self.catch_up()
        return self.validate_episodes()
