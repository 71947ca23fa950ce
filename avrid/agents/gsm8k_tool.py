"""Chapter 7 — the real-model recipe: GSM8K with a Python tool, for a chat model on a GPU.

The policy reasons in text and may run Python: it writes the code between ``<tool_call>``
and ``</tool_call>`` (Qwen2.5's tool markers, each one token of its tokenizer), its turn
stops at the closing marker, the run's sandbox runs the code (`tools.python`; by default the
kernel's namespaces: the code cannot read the GSM8K file, or anything of the host but a
read-only Python runtime, has no network, and everything it starts dies with the call), and
what it printed comes back as the next observation:

    <tool_response>
    42
    </tool_response>

A turn without a call is the final answer, scored as chapter 5's GSM8K task scores a
response: 1 if its last ``#### <number>`` equals the ground truth (`gsm8k.Gsm8kTask`).

Run it with ``avrid ppo --preset qwen-gsm8k --set task.name=avrid.agents.gsm8k_tool:make_task``
plus ``rollout.max_response_tokens`` for the episode (prompt, turns and tool outputs).

Not here: the file format and the answer check (`avrid.ppo.setup.gsm8k`), the sandbox.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from avrid.agents.env import EpisodeLimits, StepResult
from avrid.agents.tools import parse_call, python
from avrid.ppo.setup.gsm8k import Gsm8kTask
from avrid.ppo.setup.task import Prompt

OPEN, CLOSE = "<tool_call>", "</tool_call>"
INSTRUCTION = (f"You may run Python to compute: write code between {OPEN} and {CLOSE} and it "
               f"runs; what it prints comes back. Think step by step and output the final "
               f"answer after '####'.")


@dataclass(slots=True, kw_only=True)
class Gsm8kToolEnv:
    """One episode: calls run in the sandbox, the answer is scored by `task`."""

    prompt: Prompt
    task: Gsm8kTask
    wall_s: float
    memory_mb: int

    def reset(self) -> str:
        return self.prompt.text

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        code = parse_call(action_text.rstrip(), open_mark=OPEN, close_mark=CLOSE)
        if code is None:
            return StepResult(observation="", reward=self.task.reward(self.prompt, action_text),
                              done=True)
        # The marker's neighbours are the model's whitespace, not the code's indentation.
        code = textwrap.dedent(code).strip()
        result = python(code, wall_s=self.wall_s, memory_mb=self.memory_mb)
        return StepResult(observation=f"\n<tool_response>\n{result.observation()}\n"
                                      f"</tool_response>\n",
                          tool_calls=1, tool_errors=int(result.status != "ok"),
                          tool_seconds=result.seconds)


class Gsm8kToolTask:
    """GSM8K prompts from a local file (`Gsm8kTask`'s arguments) with the Python tool."""

    name = "gsm8k_tool"
    alphabet = None
    turn_stops = CLOSE

    def __init__(self, path: str | os.PathLike[str], *, max_turns: int = 4,
                 turn_tokens: int = 512, max_tokens: int = 1536, tool_wall_s: float = 5.0,
                 tool_memory_mb: int = 512, **gsm8k_options: object) -> None:
        gsm8k_options.setdefault("instruction", INSTRUCTION)
        self.task = Gsm8kTask(path, max_response_tokens=max_tokens,
                              **gsm8k_options)  # type: ignore[arg-type]
        self.limits = EpisodeLimits(max_turns=max_turns, turn_tokens=turn_tokens,
                                    max_tokens=max_tokens, tool_wall_s=tool_wall_s)
        self.tool_memory_mb = tool_memory_mb

    @property
    def max_response_tokens(self) -> int:
        return self.limits.max_tokens

    def train_prompts(self) -> Sequence[Prompt]:
        return self.task.train_prompts()

    def val_prompts(self) -> Sequence[Prompt]:
        return self.task.val_prompts()

    def reward(self, prompt: Prompt, response: str) -> float:
        raise NotImplementedError("gsm8k_tool is multi-turn: its environment scores each "
                                  "episode (Gsm8kToolEnv.step); run it with avrid.agents")

    def make_env(self, prompt: Prompt) -> Gsm8kToolEnv:
        return Gsm8kToolEnv(prompt=prompt, task=self.task, wall_s=self.limits.tool_wall_s,
                            memory_mb=self.tool_memory_mb)


def make_task(**options: object) -> Gsm8kToolTask:
    """The catalog's factory: ``--set task.name=avrid.agents.gsm8k_tool:make_task``; `path`
    comes from ``task.path`` (the qwen-gsm8k preset's GSM8K file)."""
    return Gsm8kToolTask(**options)  # type: ignore[arg-type]
