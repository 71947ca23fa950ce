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
(`columns.action_mask`). `EpisodeSteps` holds those changes, shared with chapter 6's modes
(`pipelined.py`); `avrid.agents.make_trainer` picks the trainer.

Not here: the episode loop (`episodes.py`), the rollout on a worker (`worker.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from avrid.agents.env import is_agent_task
from avrid.agents.sandbox import SandboxUnavailable
from avrid.agents.worker import AgentPolicyWorker, sandbox_for
from avrid.dispatch import Batch
from avrid.ppo.data.columns import with_responses
from avrid.ppo.data.prompts import VAL, prompt_batch
from avrid.ppo.driver.scoring import Phase
from avrid.ppo.driver.trainer import Trainer, step_seed
from avrid.ppo.setup.config import PPOConfig
from avrid.results import Merged, Phases, WorkerResult, run_shards
from avrid.workers import PlacementPlan, WorkerGroup


class EpisodeSteps:
    """What chapter 7 changes in a trainer's step, for the synchronous `AgentTrainer` and
    chapter 6's `pipelined.AgentPipelinedTrainer` alike (listed first in their bases, so
    these methods replace the trainer's): no reward call, the episode metrics, validation
    on episodes."""

    def score(self, batch: Batch, phase: Phase | None = None) -> tuple[Batch, list[Merged]]:
        """The environment has scored every episode already (its "score" column): no call,
        no phase."""
        return batch, []

    def _metrics(self, batch: Batch, merged: list[Merged], phases: Phases) -> dict[str, float]:
        out = super()._metrics(batch, merged, phases)
        action = batch.packed["action_mask"].values.float()
        out["agent/action_share"] = float(action.mean()) if action.numel() else 0.0
        return out

    def validate_episodes(self) -> dict[str, float]:
        """Mean episode score on the held-out prompts (greedy unless rollout.val_greedy=False),
        and how the episodes used their tools."""
        prompts = prompt_batch(self.val_set, range(len(self.val_set)), repeats=1, first_id=0,
                               split=VAL)
        gen = run_shards(*self.generator(), prompts, None, max_new_tokens=self.max_response,
                         greedy=self.config.rollout.val_greedy,
                         seed=step_seed(self.config, -1))
        batch = with_responses(prompts, gen.batch)
        s = batch.scalars
        return {"val/reward": float(s["score"].mean()),
                "val/response_len": float(batch.response_lens.float().mean()),
                "val/truncation_rate": float(s["truncated"].float().mean()),
                "val/tool_calls": float(s["tool_calls"].float().mean()),
                "val/turns": float(s["turns"].float().mean())}


def check_agent_task(task: object, config: PPOConfig) -> None:
    """A trainer of episodes refuses a single-turn task, and a reward function beside a
    multi-turn one (its environments give the rewards; the function would never be called),
    in one line."""
    if not is_agent_task(task):
        raise ValueError(f"task {config.task.name!r} is single-turn (no make_env, limits, "
                         f"turn_stops): train it with avrid.pipeline.train")
    if config.task.reward_weights:
        field = "task.reward" if config.task.reward is not None else "task.rewards"
        raise ValueError(f"config field {field!r}: task {config.task.name!r} is multi-turn, "
                         f"so its environments give the rewards (StepResult.reward) and a "
                         f"reward function would never be called; drop {field} or give the "
                         f"task's environment that reward")
    if config.reward_model.enabled:
        raise ValueError(f"config field 'reward_model.path': task {config.task.name!r} is "
                         f"multi-turn, so its environments give the rewards "
                         f"(StepResult.reward) and a reward model would never be called; "
                         f"drop reward_model.path")


def check_tools(config: PPOConfig) -> None:
    """Before anything starts: with ``tools.sandbox=remote``, that the service answers (a
    ValueError naming the field and the URL); with ``process``, the warning that it is no
    boundary, in the driver's output too."""
    if config.tools.sandbox == "remote":
        try:
            sandbox_for(config.tools).check()
        except SandboxUnavailable as e:  # a setting to fix, reported as the config's errors are
            raise ValueError(f"config field 'tools.remote_url': {e}") from e
    elif config.tools.sandbox == "process":
        sandbox_for(config.tools)


class AgentTrainer(EpisodeSteps, Trainer):
    """Chapter 5's synchronous loop over multi-turn episodes (see the module docstring)."""

    policy_worker = AgentPolicyWorker

    def __init__(self, config: PPOConfig) -> None:
        if config.pipeline.disaggregated:  # never run another mode than the one asked for
            raise ValueError(f"pipeline.mode={config.pipeline.mode!r} runs episodes in "
                             f"avrid.agents.pipelined.AgentPipelinedTrainer; this trainer "
                             f"runs pipeline.mode='sync'")
        check_tools(config)
        super().__init__(config)
        check_agent_task(self.task, config)

    def placement(self) -> PlacementPlan:
        """Chapter 5's placement, its policy ranks running `AgentPolicyWorker`."""
        plan = super().placement()
        roles = tuple(dataclasses.replace(r, worker=self.policy_worker)
                      if r.role == "policy" else r for r in plan.roles)
        return dataclasses.replace(plan, roles=roles)

    def generator(self) -> tuple[WorkerGroup, Callable[..., WorkerResult]]:
        """The policy ranks' episode rollout (`AgentPolicyWorker.generate`)."""
        return self.policy, AgentPolicyWorker.generate

    def sampling(self, step: int, round: int = 0) -> dict[str, int | bool]:
        """Chapter 5's sampling arguments, plus the weight "version" the policy's engines
        hold at step `step`: the actor updates made before it (chapter 6 counts the same),
        stamped on every policy token."""
        updates = max(0, step - self.config.train.critic_warmup_steps)
        return {**super().sampling(step, round), "version": updates}

    def validate(self) -> dict[str, float]:
        """`EpisodeSteps.validate_episodes` by the policy ranks."""
        return self.validate_episodes()
