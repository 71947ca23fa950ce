"""Chapter 7 — the laptop task: multiply with a calculator tool ("48*7=" -> "[48*7]" -> "336").

A tiny model cannot multiply in its weights in minutes (and the validation products are
ones it never trains on), but it can learn to ask: an episode is

    prompt      "48*7="
    turn 1      "[48*7]"       the policy calls the calculator (the turn stops at "]")
    observation "336;"         the environment runs it and answers
    turn 2      "336<eos>"     the policy answers; the episode ends, scored

The reward is chapter 5's digit credit of the final answer (the share of its digits in the
right place), plus `call_bonus` when the episode made a well-formed call to the calculator
with the prompt's own expression (0 by default; the preset says what it uses and why). A
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
    call_bonus: float = 0.0
    _called: list[bool] = field(default_factory=list)  # whether the right call was made

    def reset(self) -> str:
        return self.prompt.text

    def step(self, action_ids: Sequence[int], action_text: str) -> StepResult:
        call = parse_call(action_text)
        if call is None:  # the final answer
            answer = self.prompt.answer
            credit = sum(a == r for a, r in zip(answer, action_text, strict=False)) / len(answer)
            bonus = self.call_bonus if self._called else 0.0
            return StepResult(observation="", reward=credit + bonus, done=True)
        result = calculator(call)
        if call == self.prompt.text.removesuffix("="):
            self._called.append(True)
        # The tool's error message is not in this task's alphabet: "=" stands for "no value".
        text = result.output if result.status == "ok" else "="
        return StepResult(observation=text + ";", tool_calls=1,
                          tool_errors=int(result.status != "ok"),
                          tool_seconds=result.seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class CalcTask:
    """Products of a `digits`-digit number and a one-digit number; the validation products
    are never trained on. `max_turns` and `call_bonus` as in the module docstring."""

    digits: int = 2
    num_val: int = 30
    seed: int = 0
    max_turns: int = 3
    call_bonus: float = 0.0
    name: str = "calc"
    alphabet: str = ALPHABET
    turn_stops: str = "]"

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 4:
            raise ValueError(f"calc: digits must be 1..4, got {self.digits!r}")
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
        return [Prompt(index=i, text=f"{a}*{b}=", answer=str(a * b))
                for i, (a, b) in enumerate(pairs)]

    def train_prompts(self) -> list[Prompt]:
        return self._prompts(self._pairs()[self.num_val:])

    def val_prompts(self) -> list[Prompt]:
        return self._prompts(self._pairs()[:self.num_val])

    def reward(self, prompt: Prompt, response: str) -> float:
        raise NotImplementedError("calc is multi-turn: its environment scores each episode "
                                  "(CalcEnv.step), run it with avrid.agents")

    def make_env(self, prompt: Prompt) -> CalcEnv:
        return CalcEnv(prompt=prompt, call_bonus=self.call_bonus)


def make_task(**options: object) -> CalcTask:
    """The catalog's factory: ``--task avrid.agents.calc:make_task``."""
    return CalcTask(**options)  # type: ignore[arg-type]
