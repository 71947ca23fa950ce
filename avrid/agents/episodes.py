"""Chapter 7 — the episode loop: many multi-turn episodes over one engine, each at its own pace.

An episode alternates two kinds of wait: the engine generating its turn, and the
environment answering it (a tool may take 200 ms, or time out after 5 s). Run turn by turn
for the whole batch ("turn_sync"), the engine sits idle until the slowest tool of each turn
returns. Scheduled per trajectory (the default), an episode goes back to the engine the
moment its observation arrives, while others still wait on their tools:

    ready ──► engine.generate(every ready context) ──► turn ended at a stop token?
      ▲                                                  │ no: the turn continues (a segment
      │                                                  │     ended; see below) ──► ready
      │                                                  ▼ yes
      └── observation appended ◄── env.step on a thread (tools run here) ──► done: finished

Each call generates for the episodes ready at that moment; on vLLM the call is one
continuously batched `generate`. Environments step on a thread pool, so tools of different
episodes run at once while the engine works.

Partial rollouts: a turn may be generated in segments of `segment_tokens`. Between two
engine calls the loop asks its `WeightSource` which version the engine holds (the source
loads newly arrived weights first): the next segment continues the same turn from its tokens
so far under the new weights (abort and resume), and each token records the version that
generated it. With the default source (`FixedVersion`) every token has one version.

Reproducibility: every call's seed comes from (seed, call number), so "turn_sync" gives the
same episodes for the same seed and weights. "per_trajectory" batches whatever is ready, which
depends on how long the tools took: each episode is still a valid sample of the policy, but
which episodes share a call (and so the exact samples) can change from run to run.

Not here: what an environment is (`env.py`), the token record (`trajectory.py`), turning
episodes into a training batch on a worker (`worker.py`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from avrid.agents.env import Environment, EpisodeLimits, StepResult
from avrid.agents.trajectory import Trajectory
from avrid.ppo.engines.torch_engine import SamplingParams
from avrid.ppo.setup.task import Prompt, check_reward
from avrid.ppo.setup.tokenizer import Tokenizer

Schedule = Literal["per_trajectory", "turn_sync"]
SCHEDULES: tuple[str, ...] = ("per_trajectory", "turn_sync")


class WeightSource(Protocol):
    """Where new weights come from during a rollout (chapter 6's async mode)."""

    def poll(self) -> int:
        """Load any weights that arrived since the last call into the engine; return the
        weight version the engine holds now. Called before every engine call."""
        ...


@dataclass(frozen=True, slots=True)
class FixedVersion:
    """A `WeightSource` whose weights never change mid-rollout: the synchronous loop's."""

    version: int

    def poll(self) -> int:
        return self.version


@dataclass(slots=True)
class LoopStats:
    """Where one `run_episodes` call spent its time."""

    wall_s: float = 0.0
    """From the first reset to the last episode finished."""
    busy_s: float = 0.0
    """Inside the engine's generate calls."""
    engine_calls: int = 0
    versions: list[int] = field(default_factory=list)
    """The version the engine held at each call."""

    @property
    def busy_share(self) -> float:
        """busy_s / wall_s: how much of the rollout the engine was generating."""
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(slots=True)
class _Episode:
    index: int
    env: Environment
    prompt: Prompt | None
    traj: Trajectory
    turn_start: int = 0  # where the current policy turn starts in traj.ids
    mid_turn: bool = False  # the current turn was cut by a segment and goes on


def run_episodes(engine: Any, envs: Sequence[Environment], *, tokenizer: Tokenizer,
                 limits: EpisodeLimits, params: SamplingParams,
                 prompts: Sequence[Prompt | None] | None = None,
                 schedule: Schedule = "per_trajectory", tool_threads: int = 8,
                 segment_tokens: int | None = None, weights: WeightSource | None = None,
                 task_name: str = "agent") -> tuple[list[Trajectory], LoopStats]:
    """Run one episode per environment to its end; returns the trajectories (in `envs`'
    order) and the loop's timing.

    `params` gives the sampling (temperature, top-k/p, greedy, stop ids: EOS and the turn
    stops, seed); its `max_new_tokens` is ignored: each turn gets `limits.turn_tokens`, and
    at most what is left of `limits.max_tokens`. `prompts` (optional, one per env) name the
    prompt in a reward's error message.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if segment_tokens is not None and segment_tokens < 1:
        raise ValueError(f"segment_tokens must be >= 1 or None, got {segment_tokens!r}")
    weights = weights or FixedVersion(0)
    stats = LoopStats()
    start = time.perf_counter()
    episodes = [_Episode(i, env, prompts[i] if prompts else None,
                         Trajectory(prompt=tuple(_prompt_ids(env.reset(), tokenizer))))
                for i, env in enumerate(envs)]
    ready: deque[_Episode] = deque(episodes)
    pending: dict[Future[StepResult], _Episode] = {}
    with ThreadPoolExecutor(max_workers=max(1, tool_threads),
                            thread_name_prefix="avrid-env") as pool:
        while ready or pending:
            if pending and (schedule == "turn_sync" or not ready):
                # turn_sync: every episode waits for the slowest tool of the turn.
                wait(pending, return_when=ALL_COMPLETED if schedule == "turn_sync"
                     else FIRST_COMPLETED)
            for fut in [f for f in pending if f.done()]:
                ep = pending.pop(fut)
                if _observe(ep, _answer(fut, ep, task_name), tokenizer, limits, task_name):
                    ready.append(ep)
            if not ready:
                continue
            batch = sorted(ready, key=lambda e: e.index)  # a fixed order within a call
            ready.clear()
            for ep in _generate(engine, batch, params, limits, segment_tokens, weights, stats):
                if ep.mid_turn:
                    ready.append(ep)  # a segment ended inside the turn: it goes on
                else:
                    turn = ep.traj.ids[ep.turn_start:]
                    pending[pool.submit(ep.env.step, turn, tokenizer.decode(turn))] = ep
    stats.wall_s = time.perf_counter() - start
    return [ep.traj for ep in episodes], stats


def _generate(engine: Any, batch: list[_Episode], params: SamplingParams,
              limits: EpisodeLimits, segment_tokens: int | None, weights: WeightSource,
              stats: LoopStats) -> list[_Episode]:
    """One engine call for `batch`; appends each episode's new tokens. Each row gets its
    own budget (the rest of its turn, of the episode, of the segment): the call runs to the
    largest and every row is cut at its own (the tokens it keeps never depend on the ones
    dropped after them: each token depends only on those before it)."""
    version = weights.poll()
    budgets = []
    for ep in batch:
        if not ep.mid_turn:
            ep.turn_start = len(ep.traj.ids)
        used = len(ep.traj.ids) - ep.turn_start
        budget = min(limits.turn_tokens - used, limits.max_tokens - len(ep.traj.ids))
        budgets.append(budget if segment_tokens is None else min(budget, segment_tokens))
    call = replace(params, max_new_tokens=max(budgets),
                   seed=(params.seed * 1_000_003 + stats.engine_calls * 7919) % (1 << 62))
    t0 = time.perf_counter()
    outs = engine.generate([ep.traj.context for ep in batch], call)
    stats.busy_s += time.perf_counter() - t0
    stats.engine_calls += 1
    stats.versions.append(version)
    stops = set(params.stop_token_ids)
    for ep, out, budget in zip(batch, outs, budgets, strict=True):
        ids, logps = list(out.token_ids[:budget]), list(out.logprobs[:budget])
        stopped = bool(ids) and ids[-1] in stops
        ep.traj.add_policy(ids, logps, [version] * len(ids), continues=ep.mid_turn)
        used = len(ep.traj.ids) - ep.turn_start
        room = min(limits.turn_tokens - used, limits.max_tokens - len(ep.traj.ids))
        # Only a segment's own limit continues a turn; a stop token, the turn's or the
        # episode's budget ends it.
        ep.mid_turn = not stopped and room > 0 and len(ids) == budget and \
            segment_tokens is not None and budget == segment_tokens
    return batch


def _answer(fut: Future[StepResult], ep: _Episode, task_name: str) -> StepResult:
    """The environment's answer; its error names the task and the episode's prompt (a
    tool's failure is an observation, so an error here is a bug in the environment)."""
    try:
        return fut.result()
    except Exception as e:
        where = f"prompt {ep.prompt.index} ({ep.prompt.text!r})" if ep.prompt else \
            f"episode {ep.index}"
        raise RuntimeError(f"task {task_name!r}: the environment of {where} raised at turn "
                           f"{ep.traj.policy_turns}: {type(e).__name__}: {e}") from e


def _observe(ep: _Episode, step: StepResult, tokenizer: Tokenizer, limits: EpisodeLimits,
             task_name: str) -> bool:
    """Apply the environment's answer to a policy turn; True if the episode goes on."""
    traj = ep.traj
    traj.tool_calls += step.tool_calls
    traj.tool_errors += step.tool_errors
    traj.tool_seconds += step.tool_seconds
    if step.reward is not None:
        traj.reward = check_reward(step.reward, task_name=task_name, prompt=ep.prompt
                                   or Prompt(index=ep.index, text="?", answer="?"))
    if step.done:
        traj.done = True
        return False
    obs = _ids(step.observation, tokenizer)
    # The episode ends on a limit after a whole turn or observation: a cut observation
    # would show the policy a context the environment never gave.
    if traj.policy_turns >= limits.max_turns or \
            len(traj.ids) + len(obs) >= limits.max_tokens:
        traj.truncated = True
        return False
    traj.add_observation(obs)
    return True


def _prompt_ids(prompt: str | Sequence[int], tokenizer: Tokenizer) -> list[int]:
    """The first context as token ids: text as the task's prompts are (`Tokenizer.encode`:
    a chat model's template included), ids as they are."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return [int(t) for t in prompt]


def _ids(observation: str | Sequence[int], tokenizer: Tokenizer) -> list[int]:
    """An observation as token ids: text is tokenized (once, here, as it is: no chat template
    around it), ids are kept."""
    if isinstance(observation, str):
        return tokenizer.encode_text(observation)
    return [int(t) for t in observation]
