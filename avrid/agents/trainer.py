"""Chapter 7 — the PPO/GRPO loop on multi-turn episodes: chapter 5's trainer, two phases changed.

`AgentTrainer` is chapter 5's `Trainer` with:

- generate  the policy ranks run whole episodes (`worker.AgentPolicyWorker`): the batch's
            "response" is every token after the prompt (policy turns and observations),
            with "action_mask" marking the policy's own;
- reward    nothing to call: the environment scored each episode as it ended (its "score").

Everything else is chapter 5's, unchanged: old/ref log-probs and values are computed on the
exact ids of the episode, the advantages run over the action tokens only (the estimator
sees each row's policy tokens, right-padded: GAE steps from one action token to the next
across an observation, `data/credit.py`), and the losses weigh action tokens only
(`columns.action_mask`). `make_trainer` / `train` pick this trainer for a task that has the
multi-turn members (`env.is_agent_task`) and chapter 6's otherwise.

Not here: the episode loop (`episodes.py`), the rollout on a worker (`worker.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from avrid.agents.env import is_agent_task
from avrid.agents.worker import AgentPolicyWorker, agent_task
from avrid.dispatch import Batch
from avrid.pipeline import make_trainer as pipeline_trainer
from avrid.ppo.data.columns import with_responses
from avrid.ppo.data.prompts import VAL, prompt_batch
from avrid.ppo.driver.run import RunSummary
from avrid.ppo.driver.run import train as run_train
from avrid.ppo.driver.trainer import Trainer, step_seed
from avrid.ppo.setup.config import PPOConfig
from avrid.results import Merged, Phases, WorkerResult, run_shards
from avrid.workers import PlacementPlan, WorkerGroup


class AgentTrainer(Trainer):
    """Chapter 5's synchronous loop over multi-turn episodes (see the module docstring)."""

    policy_worker = AgentPolicyWorker

    def __init__(self, config: PPOConfig) -> None:
        if config.pipeline.disaggregated:
            raise ValueError(f"multi-turn tasks run pipeline.mode='sync' for now (got "
                             f"{config.pipeline.mode!r}): chapter 6's rollout pool does not "
                             f"run episodes yet")
        super().__init__(config)
        if not is_agent_task(self.task):
            raise ValueError(f"task {config.task.name!r} is single-turn (no make_env, limits, "
                             f"turn_stops): train it with avrid.pipeline.train")

    def placement(self) -> PlacementPlan:
        """Chapter 5's placement, its policy ranks running `AgentPolicyWorker`."""
        plan = super().placement()
        roles = tuple(dataclasses.replace(r, worker=self.policy_worker)
                      if r.role == "policy" else r for r in plan.roles)
        return dataclasses.replace(plan, roles=roles)

    def generator(self) -> tuple[WorkerGroup, Callable[..., WorkerResult]]:
        """The policy ranks' episode rollout (`AgentPolicyWorker.generate`)."""
        return self.policy, AgentPolicyWorker.generate

    def score(self, batch: Batch) -> tuple[Batch, Merged]:
        """The environment has scored every episode already (its "score" column): no call."""
        return batch, Merged(batch=batch.only(), metrics={}, results=())

    def _metrics(self, batch: Batch, merged: list[Merged], phases: Phases) -> dict[str, float]:
        out = super()._metrics(batch, merged, phases)
        action = batch.packed["action_mask"].values.float()
        out["agent/action_share"] = float(action.mean()) if action.numel() else 0.0
        return out

    def validate(self) -> dict[str, float]:
        """Mean episode score on the held-out prompts (greedy unless rollout.val_greedy=False),
        and how the episodes used their tools."""
        r = self.config.rollout
        prompts = prompt_batch(self.val_set, range(len(self.val_set)), repeats=1, first_id=0,
                               split=VAL)
        gen = run_shards(*self.generator(), prompts, None, max_new_tokens=self.max_response,
                         greedy=r.val_greedy, seed=step_seed(self.config, -1))
        batch = with_responses(prompts, gen.batch)
        s = batch.scalars
        return {"val/reward": float(s["score"].mean()),
                "val/response_len": float(batch.response_lens.float().mean()),
                "val/truncation_rate": float(s["truncated"].float().mean()),
                "val/tool_calls": float(s["tool_calls"].float().mean()),
                "val/turns": float(s["turns"].float().mean())}


def make_trainer(config: PPOConfig) -> Trainer:
    """`AgentTrainer` for a multi-turn task, else chapter 6's choice (`pipeline.make_trainer`)."""
    return AgentTrainer(config) if is_agent_task(agent_task(config)) else \
        pipeline_trainer(config)


def train(config: PPOConfig, *, log: Callable[[str], None] | None = None) -> RunSummary:
    """`avrid.ppo.driver.run.train` with `make_trainer` (what ``avrid ppo`` calls)."""
    return run_train(config, log=log, make_trainer=make_trainer)


__all__ = ["AgentTrainer", "make_trainer", "train"]
