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

In one_step_off, and in async with `pipeline.partial_rollouts=false`, a push waits for the
generation in flight, as in chapter 6: a batch's tokens all come from the version it was
launched with. In async mode (partial rollouts, the default there) a push lands in the
middle: the rollout rank receives it on its "weights" lane while the episodes run, and they
take it at their next engine call (`partial.WeightMailbox`); each token keeps the version that
made it and a sample's "version" is its oldest token's, the one the staleness gate and the
queue go by. K = 0 never pushes while a batch is generated, so it is the synchronous run
exactly.

Not here: the pipeline itself (`avrid.pipeline`), the episode loop (`episodes.py`).
"""

from __future__ import annotations

import time
from typing import Any

from avrid.agents.partial import WeightMailbox
from avrid.agents.trainer import EpisodeSteps, check_agent_task, check_tools
from avrid.agents.worker import agent_shard, agent_task, episode_limits
from avrid.dispatch import Shard
from avrid.pipeline import PipelinedTrainer
from avrid.pipeline.rollout import Received, RolloutWorker
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.tokenizer import make_tokenizer
from avrid.results import WorkerResult
from avrid.workers import WorkerIdentity


class AgentRolloutWorker(RolloutWorker):
    """Chapter 6's rollout rank whose `generate` runs multi-turn episodes, and which takes
    pushes while it generates (`receive_weights` runs on a lane of its own)."""

    lanes = {"receive_weights": "weights"}

    def __init__(self, identity: WorkerIdentity, **kwargs: Any) -> None:
        super().__init__(identity, **kwargs)
        self.task = agent_task(self.config)
        self.tokenizer = make_tokenizer(self.config, self.task)
        self.limits = episode_limits(self.task, self.max_response)
        self.mailbox = WeightMailbox()

    def receive_weights(self, version: int) -> Received:
        """Chapter 6's receive, bucket by bucket, on this rank's "weights" lane; the engine
        loads them at once if it is idle, else between two engine calls of the episodes in
        flight (`WeightMailbox.deliver`). Received while the engine may be generating, the
        weights wait whole until then, in host memory (`RolloutWorker._receive_all`)."""
        start = time.time()
        full = self._receive_all()
        return self.mailbox.deliver(version, lambda: self._install([full], version, start),
                                    timeout_s=self._timeout_s)

    def generate(self, shard: Shard, *, max_new_tokens: int, greedy: bool, seed: int,
                 min_version: int = 0) -> WorkerResult:
        """One episode per prompt of the shard, every policy token stamped with the weight
        version that generated it ("token_version") and each sample with its oldest
        ("version"). `min_version`: the version pushed before this call (its receive runs on
        the "weights" lane, so it may land after this call starts: it is waited for)."""
        self.mailbox.begin(min_version, timeout_s=self._timeout_s)
        try:
            return agent_shard(self.engine, shard, self.identity, task=self.task,
                               tokenizer=self.tokenizer, limits=self.limits,
                               config=self.config, stop_ids=self.stop_ids, greedy=greedy,
                               seed=seed, schedule=self.config.rollout.agent_schedule,
                               segment_tokens=self.config.rollout.agent_segment_tokens,
                               weights=self.mailbox, stamp_versions=True)
        finally:
            self.mailbox.end()


class AgentPipelinedTrainer(EpisodeSteps, PipelinedTrainer):
    """Chapter 6's pipelined trainer over multi-turn episodes (see the module docstring)."""

    rollout_worker = AgentRolloutWorker

    def __init__(self, config: PPOConfig) -> None:
        check_tools(config)
        super().__init__(config)
        check_agent_task(self.task, config)
        p = config.pipeline
        self.pushes_mid_generation = p.mode == "async" and p.partial_rollouts

    def sampling(self, step: int, round: int = 0) -> dict[str, int | bool]:
        """Chapter 5's sampling arguments, plus the version the rollout engines were last
        pushed: the generation starts from it (`AgentRolloutWorker.generate`)."""
        return {**super().sampling(step, round), "min_version": self.rollout_version or 0}

    def _pump(self) -> None:
        """Chapter 6's pump; before it, with partial rollouts, a push of newer weights while
        a generation is in flight (it lands between two of its engine calls). One push at a
        time: while the last one waits for a call boundary, the next waits for a later pump."""
        busy = self._inflight is not None and not self._inflight.call.done()
        if busy and self.pushes_mid_generation and self.rollout_version != self.trainer_version \
                and (self._pushing is None or self._pushing.done()):
            self._push()
        super()._pump()

    def validate(self) -> dict[str, float]:
        """Episodes on the held-out prompts by the rollout pool, brought to the trainer's
        weights first (`PipelinedTrainer.catch_up`)."""
        self.catch_up()
        return self.validate_episodes()
