"""Chapter 5 — a step's scores: the rule reward and, with `reward_model.path`, the reward model.

The trainer's `score` hands a generated batch to `score_batch`, which runs up to two phases,
each one dispatch and one canonical result, each its own bar on the timeline:

    reward        the rule reward worker (`roles/reward.py`): the task's reward, or the
                  weighted `task.reward`/`task.rewards` functions -> "rule_score"
    reward_model  the reward model's ranks (`roles/reward_model.py`), the batch split over
                  them by chapter 2's token-aware planner -> "model_score"

and combines them (`combined`; `reward_model.py` in setup explains the weights):

    score = rule_weight x rule_score + weight x model_score

Without a reward model the score is the rule reward itself, untouched (same-seed metrics do
not move); with ``rule_weight=0`` the rule reward is not computed at all. This file knows
nothing of steps, advantages or validation: it scores a batch and returns the calls made
(its parts are public so that the concurrent controller, `concurrent.py`, can run the
two calls side by side).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from avrid.dispatch import Batch, DispatchConfig
from avrid.ppo.data.columns import add_columns
from avrid.ppo.driver.reward_stream import RewardStream
from avrid.ppo.roles.reward import SCORE_READS, RewardWorker
from avrid.ppo.roles.reward_model import RewardModelWorker
from avrid.ppo.setup.reward_model import RewardModelConfig
from avrid.results import Merged, run_shards
from avrid.workers import WorkerGroup

Phase = Callable[[str], AbstractContextManager[None]]
"""What times a named phase (the step's `Phases`); `score` without it times nothing."""


def score_batch(batch: Batch, *, config: RewardModelConfig, reward: WorkerGroup,
                model: WorkerGroup | None, phase: Phase | None = None,
                stream: RewardStream | None = None) -> tuple[Batch, list[Merged]]:
    """`batch` with its "score" column (and "model_score" with a reward model), and the
    calls that made them, in the order they ran: `reward` is the rule reward's group,
    `model` the reward model's (None without one); `stream`: where the rule reward may
    have been scored already, as the batch was generated (`rollout.stream_rewards`)."""
    phase = phase or (lambda name: nullcontext())
    calls: list[Merged] = []
    rule = None
    if not config.enabled or config.rule_weight != 0:
        with phase("reward"):
            calls.append(rule_reward(reward, batch, stream))
        rule = calls[-1].batch.scalars["score"]
        if not config.enabled:  # the rule reward alone, as it is
            return add_columns(batch, scalars={"score": rule}), calls
    if model is None:
        raise ValueError("reward_model.path is set but no reward_model group was started")
    with phase("reward_model"):
        calls.append(model_scores(model, batch))
    model_score = calls[-1].batch.scalars["model_score"]
    return add_columns(batch, scalars=combined(config, rule, model_score)), calls


def rule_reward(reward: WorkerGroup, batch: Batch, stream: RewardStream | None) -> Merged:
    """The rule reward of `batch`: the calls `stream` started as `batch` was generated, if
    it did (`reward_stream.py`: the very result `rule_scores` gives, bit for bit), else
    `rule_scores` now."""
    streamed = None if stream is None else stream.take(batch)
    return streamed if streamed is not None else rule_scores(reward, batch)


def rule_scores(reward: WorkerGroup, batch: Batch) -> Merged:
    """The rule reward worker's call on `batch`: its "score" scalar is the rule score."""
    return run_shards(reward, RewardWorker.score, batch.only(*SCORE_READS))


def model_scores(model: WorkerGroup, batch: Batch) -> Merged:
    """The reward model's call on `batch`: its "model_score" scalar."""
    # The plan balances the policy's token counts over the ranks (Karmarkar-Karp), a proxy
    # for the RM's; it cuts no micro-batches: each rank cuts its forwards by its own
    # tokenizer's lengths (`padded_micro_batches`), which only it knows.
    return run_shards(model, RewardModelWorker.score, batch.only(*SCORE_READS),
                      DispatchConfig())


def combined(config: RewardModelConfig, rule: torch.Tensor | None,
             model_score: torch.Tensor) -> dict[str, torch.Tensor]:
    """The "score" and "model_score" columns: rule_weight x rule + weight x model_score
    (`rule` None: the rule reward was not computed, ``rule_weight=0``)."""
    score = config.weight * model_score
    if rule is not None:
        score = config.rule_weight * rule + score
    return {"score": score, "model_score": model_score}
