"""Chapter 5 — tasks: the prompts the policy answers and the verifiable reward that scores them.

A task is the "environment" of RL post-training with verifiable rewards: a list of training
prompts, a held-out list of validation prompts, and a function that scores a decoded response
against the prompt's ground truth. The trainer only ever sees the `Task` protocol:

- `digits.DigitTask` — built in: "381=" -> "183" (reverse, copy or sort a digit string);
- `gsm8k.Gsm8kTask` — grade-school maths from a local GSM8K file, for real models;
- your own task, through ``catalog.load_task("package.module:factory")``.

This file is the contract (`Prompt`, `Task`, `check_reward`). It does not find tasks by name
(`catalog.py`), tokenize (`tokenizer.py`), or sample, batch and shuffle across epochs
(`data/prompts.py`), and it never downloads data.

Plugging in your own task
-------------------------
Write a module on the import path of the driver *and* the Ray workers (e.g. in your project,
installed or on PYTHONPATH) with a factory that returns an object having the members of
`Task`::

    # my_tasks.py
    from avrid.ppo.setup.task import Prompt

    class ParityTask:
        name = "parity"
        max_response_tokens = 2     # one answer character + EOS
        alphabet = "01=EO"          # for a CharTokenizer; None if you need a real tokenizer

        def train_prompts(self):
            return [Prompt(index=i, text=f"{n:04b}=", answer="EO"[n % 2])
                    for i, n in enumerate(range(12))]

        def val_prompts(self):      # held out: no prompt of the training list
            return [Prompt(index=i, text=f"{n:04b}=", answer="EO"[n % 2])
                    for i, n in enumerate(range(12, 16))]

        def reward(self, prompt, response):
            return 1.0 if response.strip() == prompt.answer else 0.0

    def make_task(**kwargs):
        return ParityTask(**kwargs)

then ``catalog.load_task("my_tasks:make_task")`` (or ``--task my_tasks:make_task`` on the
command line).
`load_task` checks the object against the protocol and that both prompt lists are non-empty;
the trainer passes every reward through `check_reward`, so a NaN fails loudly, naming the
prompt, instead of silently poisoning the advantages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True, kw_only=True)
class Prompt:
    """One prompt of a task.

    Attributes:
        index: position in its split (train or validation); stable across runs.
        text: what the model is given (before tokenization).
        answer: the ground truth the task's reward checks the response against.
        metadata: anything else about the prompt (a row's other columns, the task's
            operation), passed to a reward function (`reward_functions.py`) as keyword
            arguments. Left out of the hash: a dict has none.
    """

    index: int
    text: str
    answer: str
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False)


@runtime_checkable
class Task(Protocol):
    """A set of prompts with a verifiable reward. See the module docstring for an example."""

    @property
    def name(self) -> str:
        """Short name for logs and run directories."""
        ...

    @property
    def max_response_tokens(self) -> int:
        """A hint for the config default: enough tokens for a full answer plus EOS."""
        ...

    @property
    def alphabet(self) -> str | None:
        """Characters a CharTokenizer needs for this task; None if it needs a real tokenizer."""
        ...

    def train_prompts(self) -> Sequence[Prompt]:
        """The prompts the policy is trained on."""
        ...

    def val_prompts(self) -> Sequence[Prompt]:
        """Held-out prompts (disjoint from the training prompts) for evaluation."""
        ...

    def reward(self, prompt: Prompt, response: str) -> float:
        """Score of `response` (decoded generated text, already cut at EOS) for `prompt`."""
        ...


TASK_MEMBERS = ("name", "max_response_tokens", "alphabet", "train_prompts", "val_prompts",
                "reward")

MAX_ABS_REWARD = 1e6
"""The largest reward magnitude accepted. Rewards are float32 and GRPO/whitening square
them: 1e300 became inf and then NaN advantages, far from the reward that caused it."""


def check_reward(value: Any, *, prompt: Prompt, task_name: str | None = None,
                 source: str | None = None) -> float:
    """`value` as a float; ValueError naming the task (or `source`, e.g. "reward function
    'm:f'") and prompt if it is not a number (a bool or a string is refused), not finite, or
    beyond +-`MAX_ABS_REWARD`.

    Example:
        >>> check_reward(1, task_name="t", prompt=Prompt(index=0, text="1=", answer="1"))
        1.0
    """
    who = source if source is not None else f"task {task_name!r}"
    where = f"{who} returned reward {value!r} for prompt {prompt.index} ({prompt.text!r})"
    # float("0.5") and float(True) work, but a string or a bool is a bug in the reward
    # function (a `==` returned instead of a score), not a score.
    if isinstance(value, str | bytes) or type(value).__name__ in ("bool", "bool_"):
        raise ValueError(f"{where}: rewards must be numbers, not {type(value).__name__}")
    try:
        reward = float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: not a number") from e
    if not math.isfinite(reward):
        raise ValueError(f"{where}: rewards must be finite")
    if abs(reward) > MAX_ABS_REWARD:
        raise ValueError(f"{where}: rewards must lie in [-{MAX_ABS_REWARD:g}, "
                         f"{MAX_ABS_REWARD:g}] (scores are float32, and the advantages square "
                         f"them); scale the reward down")
    return reward
