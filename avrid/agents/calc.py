"""Chapter 7 — the laptop task: multiply with a calculator tool ("48*7=" -> "[48*7]" -> "336").

A tiny model cannot multiply in its weights in minutes (and the validation products are
ones it never trains on), but it can learn to ask: an episode is

    prompt      "48*7="
    turn 1      "[48*7]"       the policy calls the calculator (the turn stops at "]")
    observation "336;"         the environment runs it and answers
    turn 2      "336<eos>"     the policy answers; the episode ends, scored

The reward is chapter 5's digit credit of the final answer (the share of its digits in the
right place). With `call_weight` w > 0 it is shaped towards the tool: (1 - w) x that credit
+ w x the first call's credit (the share of the prompt's expression it holds in the right
place; 0 without a call), so a right answer through a right call still scores 1. A model
that has never called the tool cannot find out that it helps from the answer alone (a
random call's result is a random number); the preset says what it uses. `hint` ends the
prompt with "[": the prompt opens the first call, as a tool-use instruction would for a
model that reads instructions (the tiny random one does not), and the policy writes the
rest of it. A
turn without a call is the final answer; a call that fails (not arithmetic) is answered
"=;" (no value: the tool's message is not in the task's alphabet), and the episode goes on.

What this file is not: the episode loop (`episodes.py`), the calculator (`tools.py`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from avrid.agents.env import EpisodeLimits, StepResult
from avrid.agents.tools import calculator, parse_call
from avrid.ppo.setup.task import Prompt

ALPHABET = "0123456789*=[];"
"""Every character of prompts, calls, observations and answers (the CharTokenizer's)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CalcEnv:
    """One episode of `CalcTask` (see the module docstring)."""

    prompt: Prompt
    call_weight: float = 0.0
    hint: bool = False
    _turns: list[str] = field(default_factory=list)  # the policy's turns so far
    _calls: list[str] = field(default_factory=list)  # the calls made so far

    def reset(self) -> str:
        return self.prompt.text

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        self._turns.append(action_text)
        # With the hint the prompt opened the first call: the turn holds the rest of it.
        opened = "[" if self.hint and len(self._turns) == 1 else ""
        call = parse_call(opened + action_text)
        if call is None:  # the final answer
            answer = _credit(self.prompt.answer, action_text)
            tool = _credit(self.prompt.text.split("=")[0], self._calls[0]) \
                if self._calls else 0.0
            w = self.call_weight
            return StepResult(observation="", reward=(1 - w) * answer + w * tool, done=True)
        self._calls.append(call)
        result = calculator(call)
        # The tool's error message is not in this task's alphabet: "=" stands for "no value".
        text = result.output if result.status == "ok" else "="
        return StepResult(observation=text + ";", tool_calls=1,
                          tool_errors=int(result.status != "ok"),
                          tool_seconds=result.seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class CalcTask:
    """Products of a `digits`-digit number and a one-digit number; the validation products
    are never trained on. `max_turns` and `call_weight` as in the module docstring."""

    digits: int = 2
    num_val: int = 30
    seed: int = 0
    max_turns: int = 3
    call_weight: float = 0.0
    hint: bool = False
    name: str = "calc"
    alphabet: str = ALPHABET
    turn_stops: str = "]"

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 4:
            raise ValueError(f"calc: digits must be 1..4, got {self.digits!r}")
        if not 0.0 <= self.call_weight < 1.0:
            raise ValueError(f"calc: call_weight must be in [0, 1), got {self.call_weight!r}")
        if not 1 <= self.num_val < len(self._pairs()) // 2:
            raise ValueError(f"calc: num_val must be 1..{len(self._pairs()) // 2 - 1}, got "
                             f"{self.num_val!r}")

    @property
    def limits(self) -> EpisodeLimits:
        # A call "[" + a*b + "]" and an answer of digits + 2 digits + EOS fit 2 * digits + 4
        # tokens a turn; each observation at most digits + 2.
        turn = 2 * self.digits + 4
        return EpisodeLimits(max_turns=self.max_turns, turn_tokens=turn,
                             max_tokens=self.max_turns * (2 * turn + 1), tool_wall_s=1.0)

    @property
    def max_response_tokens(self) -> int:
        return self.limits.max_tokens

    def _pairs(self) -> list[tuple[int, int]]:
        low, high = 10 ** (self.digits - 1), 10 ** self.digits
        pairs = [(a, b) for a in range(low, high) for b in range(2, 10)]
        random.Random(self.seed).shuffle(pairs)
        return pairs

    def _prompts(self, pairs: list[tuple[int, int]]) -> list[Prompt]:
        opened = "[" if self.hint else ""  # the hint: the prompt opens the first call
        return [Prompt(index=i, text=f"{a}*{b}={opened}", answer=str(a * b))
                for i, (a, b) in enumerate(pairs)]

    def train_prompts(self) -> list[Prompt]:
        return self._prompts(self._pairs()[self.num_val:])

    def val_prompts(self) -> list[Prompt]:
        return self._prompts(self._pairs()[:self.num_val])

    def reward(self, prompt: Prompt, response: str) -> float:
        raise NotImplementedError("calc is multi-turn: its environment scores each episode "
                                  "(CalcEnv.step), run it with avrid.agents")

    def make_env(self, prompt: Prompt) -> CalcEnv:
        return CalcEnv(prompt=prompt, call_weight=self.call_weight, hint=self.hint)


def _credit(expected: str, got: str) -> float:
    """The share of `expected`'s characters that `got` has in the same place (chapter 5's
    digit credit)."""
    return sum(a == b for a, b in zip(expected, got, strict=False)) / len(expected)


def make_task(**options: object) -> CalcTask:
    """The catalog's factory: ``--task avrid.agents.calc:make_task``."""
    return CalcTask(**options)  # type: ignore[arg-type]
