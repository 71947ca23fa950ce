"""Chapter 7 — the environment protocol: what a multi-turn task gives the episode loop.

Chapter 5's `Task` scores one response. A multi-turn task is a small gym in tokens: the
policy speaks, the environment answers, until the environment says the episode is over.

    prompt  = env.reset()                      text or token ids: the first context
    loop:   turn = policy(context)             the engine's tokens, up to a stop token
            step = env.step(turn ids, text)    -> observation, reward, done
            context += turn + step.observation (token ids: nothing is re-tokenized)

An `AgentTask` is a chapter 5 `Task` (name, alphabet, train and validation prompts, so the
prompt sets, tokenizer and validation of chapter 5 work unchanged) that also builds one
`Environment` per episode (`make_env(prompt)`) and says where a turn ends (`turn_stops`:
characters that end a policy turn besides EOS, e.g. a tool call's closing bracket) and the
episode's `limits`. Its `reward(prompt, response)` is not used: the environment scores the
episode through `StepResult.reward`.

A user's environment is plain Python in their own module, found like a task
(``--task my_module:make_task``, on the path of the driver and of every worker).

What the loop holds an environment to: `reset` and every observation are text or token ids
in range(tokenizer.vocab_size), the observation of a step with `done=True` is empty, and
`step` returns a `StepResult` within `EpisodeLimits.step_wall_s`. Anything else is a bug of
the environment and fails the whole rollout at once, with one error naming the task, the
prompt and the turn (a failing tool is not a bug: its error is an observation the policy
learns from). A step that hangs is abandoned on its thread (`step_pool.py`). An
observation longer than the tokens left ends the episode as truncated: it is never cut, and
a text far too long is not even tokenized.

Not here: running tools (`tools.py`, `sandbox.py`), the token record (`trajectory.py`), the
loop itself (`episodes.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from avrid.ppo.setup.task import Prompt, Task


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """What the environment returns after one policy turn.

    Example: ``StepResult(observation="=1776\\n", reward=None, done=False)`` after a tool
    call; ``StepResult(observation="", reward=1.0, done=True)`` after the final answer.
    """

    observation: str | Sequence[int]
    """The next observation: text (tokenized with the policy's tokenizer, without EOS) or
    token ids in range(tokenizer.vocab_size) (used as they are). Empty ("" or []) when
    `done` is True: no policy turn follows, so nothing would ever read it, and the loop
    refuses a non-empty one (an error naming the episode) rather than drop it unseen or
    append tokens no action depends on. To show the policy a last text, return it with
    `done=False` and end the episode on the next turn."""
    reward: float | None = None
    """The episode's reward when the environment has one: the last one given is the
    episode's score (outcome reward)."""
    done: bool = False
    """Whether the episode is over."""
    tool_calls: int = 0
    """Tool calls this step made (metrics: `agent/tool_calls`)."""
    tool_errors: int = 0
    """... of which failed, timed out or were refused (`agent/tool_errors`)."""
    tool_seconds: float = 0.0
    """Wall time those calls took (`agent/tool_s`)."""


@runtime_checkable
class Environment(Protocol):
    """One episode's environment. `step` may block (a tool runs); the loop calls it on a
    thread of its own, so other episodes generate meanwhile, and gives up on it after
    `EpisodeLimits.step_wall_s`."""

    def reset(self) -> str | Sequence[int]:
        """The first context of the episode: text or token ids."""
        ...

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        """React to one policy turn: its token ids (the stop token included) and their text."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeLimits:
    """How far an episode may run. Whatever limit ends an episode, it ends after a whole
    policy turn or observation, and its reward is the last one the environment gave (0
    without one)."""

    max_turns: int = 4
    """Policy turns per episode."""
    turn_tokens: int = 16
    """New tokens per policy turn (a turn hitting it is cut: finish reason "length")."""
    max_tokens: int = 64
    """Tokens after the prompt (policy turns + observations): the trajectory's response
    budget, which the trainer and the engine's context are sized for."""
    tool_wall_s: float = 5.0
    """Wall-clock seconds a tool call may take (`sandbox.ToolLimits.wall_s`)."""
    step_wall_s: float = 60.0
    """Wall-clock seconds one `env.step` may take, its tool calls included (at least
    `tool_wall_s`; several calls in one step need more). A step still running then fails the
    episode loop (a bug of the environment: its tools time out on their own), and is
    abandoned on its thread."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "turn_tokens", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EpisodeLimits.{name} must be an int >= 1, got {value!r}")
        if self.turn_tokens > self.max_tokens:
            raise ValueError(f"EpisodeLimits.turn_tokens={self.turn_tokens} exceeds "
                             f"max_tokens={self.max_tokens}")
        for name in ("tool_wall_s", "step_wall_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or \
                    not (value > 0 and math.isfinite(value)):
                raise ValueError(f"EpisodeLimits.{name} must be a finite number > 0, got "
                                 f"{value!r}")
        if self.step_wall_s < self.tool_wall_s:
            raise ValueError(f"EpisodeLimits.step_wall_s={self.step_wall_s} is less than "
                             f"tool_wall_s={self.tool_wall_s}: a step must have time for at "
                             f"least one tool call")


@runtime_checkable
class AgentTask(Task, Protocol):
    """A chapter 5 `Task` whose episodes are multi-turn (see the module docstring)."""

    @property
    def limits(self) -> EpisodeLimits:
        """Turns, tokens and tool time an episode may use."""
        ...

    @property
    def turn_stops(self) -> str:
        """What ends a policy turn besides EOS (e.g. "]" closing a tool call): EVERY token of
        its encoding (`Tokenizer.encode_text`) is a stop, so give characters of a character
        tokenizer, or a marker that is one token of a real one (Qwen's "</tool_call>")."""
        ...

    def make_env(self, prompt: Prompt) -> Environment:
        """A fresh environment for one episode on `prompt`."""
        ...


def is_agent_task(task: object) -> bool:
    """Whether `task` has the multi-turn members (`make_env`, `limits`, `turn_stops`)."""
    return all(hasattr(task, name) for name in ("make_env", "limits", "turn_stops"))
