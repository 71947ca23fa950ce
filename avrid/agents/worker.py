"""Chapter 7 — multi-turn rollouts on a policy rank: a shard of prompts in, trajectories out.

Chapter 5's policy worker samples one response per prompt (`generation.generate_shard`).
`AgentPolicyWorker` is that worker with one method replaced: `generate` runs a whole
episode per prompt through the episode loop (`episodes.run_episodes`) over the same hybrid
engine, with each prompt's environment built here, in the worker's process (a user's
environment module must be importable there, like a task's).

It returns the canonical result chapter 3 defined, with the trajectory's columns
(`trajectory.trajectory_columns`): "response" (policy turns AND observations, as the ids
they were), "rollout_logp", "action_mask", "token_version", and per sample the environment's
"score" (the driver needs no reward worker), "truncated", "turns", "tool_calls",
"tool_errors". The trainer side (chapter 5's `learn`) trains on those ids with the loss on
the action tokens only.

Not here: the loop (`episodes.py`), the driver (`trainer.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from avrid.agents.env import AgentTask, EpisodeLimits
from avrid.agents.episodes import FixedVersion, LoopStats, Schedule, WeightSource, run_episodes
from avrid.agents.sandbox import Sandbox, make_sandbox, use_sandbox
from avrid.agents.trajectory import Trajectory, trajectory_columns
from avrid.dispatch import Shard
from avrid.ppo.engines.torch_engine import SamplingParams
from avrid.ppo.roles import handoff
from avrid.ppo.roles.policy import PolicyWorker
from avrid.ppo.setup.catalog import load_task
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.tokenizer import Tokenizer, make_tokenizer
from avrid.ppo.setup.tools import ToolsConfig
from avrid.results import ResultBuilder, WorkerResult
from avrid.workers import WorkerIdentity


def agent_task(config: PPOConfig) -> AgentTask:
    """The run's task, loaded in this process (`catalog.load_task`)."""
    t = config.task
    return load_task(t.name, **t.kwargs)


@functools.cache
def sandbox_for(tools: ToolsConfig) -> Sandbox:
    """The run's tool sandbox in this process (`config.tools`): one per config, so its bound
    on concurrent calls holds across the process's episodes. Nothing starts until a tool
    runs (a task without code tools never starts one)."""
    return make_sandbox(tools.sandbox, url=tools.remote_url, concurrency=tools.concurrency,
                        retries=tools.remote_retries)


def episode_limits(task: AgentTask, max_response: int) -> EpisodeLimits:
    """The task's limits, its token budget cut to the run's response budget (the engine's
    context and the trainer's shapes are sized for it)."""
    lim = task.limits
    tokens = min(lim.max_tokens, max_response)
    return dataclasses.replace(lim, turn_tokens=min(lim.turn_tokens, tokens), max_tokens=tokens)


def agent_shard(engine: Any, shard: Shard, identity: WorkerIdentity, *, task: AgentTask,
                tokenizer: Tokenizer, limits: EpisodeLimits, config: PPOConfig,
                stop_ids: tuple[int, ...], greedy: bool, seed: int,
                schedule: Schedule = "per_trajectory", segment_tokens: int | None = None,
                weights: WeightSource | None = None,
                stamp_versions: bool = False) -> WorkerResult:
    """One episode per prompt row of `shard` (its scalars "split" and "prompt_index" name
    the prompt), as a canonical result (see the module docstring). `stamp_versions`: each
    sample gets the scalar "version" (chapter 6's), its oldest policy token's."""
    builder = ResultBuilder.for_shard(identity, shard)
    batch = shard.batch
    splits = (task.train_prompts(), task.val_prompts())
    prompts = [splits[int(s)][int(i)] for s, i in zip(batch.scalars["split"].tolist(),
                                                      batch.scalars["prompt_index"].tolist(),
                                                      strict=True)]
    r = config.rollout
    turn_stops = tuple(tokenizer.encode_text(task.turn_stops)) if task.turn_stops else ()
    params = SamplingParams(max_new_tokens=1, greedy=greedy,
                            temperature=1.0 if greedy else r.temperature,
                            top_k=0 if greedy else r.top_k, top_p=1.0 if greedy else r.top_p,
                            stop_token_ids=tuple(dict.fromkeys((*stop_ids, *turn_stops))),
                            seed=seed + identity.rank)  # one stream per rank
    # Tool calls of the environments run in the run's sandbox (`sandbox.run_python` reads it
    # from this context, which the loop hands to every environment step).
    with builder.span("generate"), use_sandbox(sandbox_for(config.tools)):
        trajectories, stats = run_episodes(
            engine, [task.make_env(p) for p in prompts], tokenizer=tokenizer, limits=limits,
            params=params, prompts=prompts, schedule=schedule, segment_tokens=segment_tokens,
            weights=weights, task_name=task.name)
    for i, traj in enumerate(trajectories):
        # The trainer puts the prompt's own ids before the response: the episode must have
        # started from exactly them, or every response token would sit one place off.
        row = tuple(batch.packed["tokens"].row(i).tolist())
        if traj.prompt != row:
            raise ValueError(f"task {task.name!r}: the environment of prompt {prompts[i].index} "
                             f"({prompts[i].text!r}) started from other tokens than the prompt "
                             f"({tokenizer.decode(traj.prompt)!r}): reset() must return the "
                             f"prompt's text (or its ids)")
    packed, columns = trajectory_columns(trajectories)
    if stamp_versions:  # a trajectory is as stale as its oldest token (the first call's)
        columns["version"] = torch.tensor(
            [min((v for v, a in zip(t.version, t.action, strict=True) if a),
                 default=stats.versions[0]) for t in trajectories], dtype=torch.int64)
    builder.add(batch.sample_ids, packed=packed, scalars=columns)
    _episode_metrics(builder, trajectories, stats)
    return builder.build()


def _episode_metrics(builder: ResultBuilder, trajectories: list[Trajectory],
                     stats: LoopStats) -> None:
    """agent/* per episode, rollout/* as chapter 5 names them."""
    def per_sample(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64)

    lengths = [len(t.ids) for t in trajectories]
    actions = sum(sum(t.action) for t in trajectories)
    builder.metric("agent/turns", per_sample([t.policy_turns for t in trajectories]),
                   "mean_samples")
    builder.metric("agent/tool_calls", per_sample([t.tool_calls for t in trajectories]),
                   "mean_samples")
    builder.metric("agent/tool_errors", per_sample([t.tool_errors for t in trajectories]),
                   "mean_samples")
    builder.metric("agent/tool_s", per_sample([t.tool_seconds for t in trajectories]),
                   "mean_samples")
    builder.metric("agent/truncated", per_sample([float(t.truncated) for t in trajectories]),
                   "mean_samples")
    builder.metric("rollout/response_len", per_sample(lengths), "mean_samples")
    builder.metric("rollout/tokens", float(actions), "sum")
    builder.metric("agent/response_tokens", float(sum(lengths)), "sum")
    builder.metric("agent/engine_busy_s", stats.busy_s, "max", per_rank=True)
    builder.metric("agent/rollout_s", stats.wall_s, "max", per_rank=True)


class AgentPolicyWorker(PolicyWorker):
    """Chapter 5's policy rank whose `generate` runs multi-turn episodes (module docstring)."""

    def __init__(self, identity: WorkerIdentity, **kwargs: Any) -> None:
        super().__init__(identity, **kwargs)
        self.task = agent_task(self.config)
        self.tokenizer = make_tokenizer(self.config, self.task)
        self.limits = episode_limits(self.task, self.max_response)

    def generate(self, shard: Shard, *, max_new_tokens: int, greedy: bool, seed: int,
                 version: int = 0) -> WorkerResult:
        """One episode per prompt of the shard (`agent_shard`); `max_new_tokens` is the run's
        response budget, which the episode limits already respect; `version`: the weight
        version the engine holds (the driver counts the updates), stamped on each policy
        token."""
        if self.engine.asleep:  # as in PolicyWorker.generate: no sync since the last call
            self._load_engine()
        result = agent_shard(self.engine, shard, self.identity, task=self.task,
                             tokenizer=self.tokenizer, limits=self.limits, config=self.config,
                             stop_ids=self.stop_ids, greedy=greedy, seed=seed,
                             schedule=self.config.rollout.agent_schedule,
                             segment_tokens=self.config.rollout.agent_segment_tokens,
                             weights=FixedVersion(version))
        handoff.to_trainer(self.engine, level=self.sleep_level)
        return result
