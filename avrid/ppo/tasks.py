"""Chapter 5 — tasks: the prompts the policy answers and the verifiable reward that scores them.

A task is the "environment" of RL post-training with verifiable rewards: a list of training
prompts, a held-out list of validation prompts, and a function that scores a decoded response
against the prompt's ground truth. The trainer only ever sees the `Task` protocol:

- `DigitTask` — built in: "381=" -> "183" (reverse, copy or sort a digit string). Small enough
  that a tiny randomly initialised model learns it on a CPU, yet the reward is real (partial
  credit per correct digit), so the whole PPO/GRPO loop can be watched working.
- `avrid.ppo.gsm8k.Gsm8kTask` — grade-school maths from a local GSM8K file, for real models.
- your own task, through ``load_task("package.module:factory")``.

What this file is not: it does not tokenize (see `tokenizer.py`), sample, batch or shuffle
across epochs (the trainer does), and it never downloads data.

Plugging in your own task
-------------------------
Write a module on the import path of the driver *and* the Ray workers (e.g. in your project,
installed or on PYTHONPATH) with a factory that returns an object having the members of
`Task`::

    # my_tasks.py
    from avrid.ppo.tasks import Prompt

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

then ``load_task("my_tasks:make_task")`` (or ``--task my_tasks:make_task`` on the command line).
`load_task` checks the object against the protocol and that both prompt lists are non-empty;
the trainer passes every reward through `check_reward`, so a NaN fails loudly, naming the
prompt, instead of silently poisoning the advantages.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, overload, runtime_checkable


@dataclass(frozen=True, slots=True, kw_only=True)
class Prompt:
    """One prompt of a task.

    Attributes:
        index: position in its split (train or validation); stable across runs.
        text: what the model is given (before tokenization).
        answer: the ground truth the task's reward checks the response against.
    """

    index: int
    text: str
    answer: str


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

DIGIT_OPS: dict[str, Callable[[str], str]] = {
    "reverse": lambda d: d[::-1],
    "copy": lambda d: d,
    "sort": lambda d: "".join(sorted(d)),
}

_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread hash of a 64-bit integer."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _shuffled(position: int, n: int, seed: int) -> int:
    """The element at `position` of a seeded shuffle of range(n), computed without the list.

    10**8 eight-digit strings do not fit in memory as a shuffled list, so the shuffle is a
    keyed permutation instead: a 4-round Feistel network on the smallest even-bit-width domain
    holding n, "cycle-walked" (re-applied until the value falls below n). Each step is a
    bijection, so the result is a bijection of range(n) — every digit string exactly once.
    """
    half = max(1, (n.bit_length() + 1) // 2)
    mask = (1 << half) - 1
    keys = [_mix64((seed * 4 + r) & _M64) for r in range(4)]
    x = position
    while True:
        left, right = x >> half, x & mask
        for key in keys:
            left, right = right, left ^ (_mix64(key ^ right) & mask)
        x = (left << half) | right
        if x < n:
            return x


@dataclass(frozen=True, slots=True, kw_only=True)
class _DigitSplit(Sequence[Prompt]):
    """A lazy slice [offset, offset + size) of the shuffled digit strings, as Prompts."""

    op: str
    length: int
    seed: int
    offset: int
    size: int

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, i: int) -> Prompt: ...
    @overload
    def __getitem__(self, i: slice) -> list[Prompt]: ...

    def __getitem__(self, i: int | slice) -> Prompt | list[Prompt]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.size))]
        if i < 0:
            i += self.size
        if not 0 <= i < self.size:
            raise IndexError(f"prompt index {i} out of range for a split of {self.size}")
        value = _shuffled(self.offset + i, 10**self.length, self.seed)
        digits = f"{value:0{self.length}d}"
        return Prompt(index=i, text=digits + "=", answer=DIGIT_OPS[self.op](digits))


@dataclass(frozen=True, slots=True, kw_only=True)
class DigitTask:
    """Built-in task: apply `op` to a string of `length` digits. "381=" -> "183" for reverse.

    All 10**length digit strings are shuffled with `seed`; the first `num_val` are the
    validation prompts and the rest the training prompts, so validation is held out.

    Reward: partial credit, the fraction of answer positions the response gets right —
    ``sum(response[i] == answer[i] for i < len(answer)) / len(answer)``. Characters after the
    answer are ignored (generation is capped at `max_response_tokens` = length + 1, room for
    the answer and EOS). A uniformly random digit guesser scores about 0.1, so an untrained
    model sits well below 0.3 and learning shows as the mean reward climbing towards 1.

    Example:
        >>> task = DigitTask(op="reverse", length=3, num_val=200)
        >>> len(task.train_prompts()), len(task.val_prompts())
        (800, 200)
        >>> p = Prompt(index=0, text="381=", answer="183")
        >>> task.reward(p, "183"), task.reward(p, "180"), task.reward(p, "")
        (1.0, 0.6666666666666666, 0.0)
    """

    op: str = "reverse"
    length: int = 3
    num_val: int = 200
    seed: int = 0

    alphabet: ClassVar[str] = "0123456789="

    def __post_init__(self) -> None:
        if self.op not in DIGIT_OPS:
            raise ValueError(f"DigitTask op {self.op!r} is not one of {sorted(DIGIT_OPS)}")
        if not 1 <= self.length <= 8:
            raise ValueError(f"DigitTask length must be in 1..8, got {self.length}")
        if not 0 < self.num_val < 10**self.length:
            raise ValueError(f"DigitTask num_val must be in 1..{10**self.length - 1} (there are "
                             f"{10**self.length} strings of {self.length} digits and training "
                             f"needs the rest), got {self.num_val}")

    @property
    def name(self) -> str:
        return f"digits-{self.op}-{self.length}"

    @property
    def max_response_tokens(self) -> int:
        return self.length + 1

    def train_prompts(self) -> Sequence[Prompt]:
        return _DigitSplit(op=self.op, length=self.length, seed=self.seed, offset=self.num_val,
                           size=10**self.length - self.num_val)

    def val_prompts(self) -> Sequence[Prompt]:
        return _DigitSplit(op=self.op, length=self.length, seed=self.seed, offset=0,
                           size=self.num_val)

    def reward(self, prompt: Prompt, response: str) -> float:
        answer = prompt.answer
        return sum(a == r for a, r in zip(answer, response, strict=False)) / len(answer)


BUILTIN_TASKS = ("digits", "gsm8k")
_ALLOWED = (f"a built-in task {', '.join(repr(b) for b in BUILTIN_TASKS)} or "
            "'package.module:factory' (a callable returning a Task)")


def _make_builtin(spec: str, kwargs: dict[str, Any]) -> Any:
    if spec == "digits":
        return DigitTask(**kwargs)
    from avrid.ppo.gsm8k import Gsm8kTask  # lazy: gsm8k imports this module

    if "path" not in kwargs:
        raise ValueError("task 'gsm8k' needs path=<a local .jsonl or .parquet file>")
    return Gsm8kTask(**kwargs)


def _make_from_factory(spec: str, kwargs: dict[str, Any]) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"task spec {spec!r} is not valid; expected {_ALLOWED}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"task spec {spec!r}: cannot import module {module_name!r} ({e}); "
                         "is it on the PYTHONPATH of the driver and the workers?") from e
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"task spec {spec!r}: module {module_name!r} has no callable "
                         f"{attr!r}; expected {_ALLOWED}")
    return factory(**kwargs)


def load_task(spec: str, **kwargs: Any) -> Task:
    """A task by name: "digits", "gsm8k" (needs path=...) or "package.module:factory".

    Keyword arguments go to the task's constructor or the factory.

    Example:
        >>> load_task("digits", op="sort", length=2, num_val=10).val_prompts()[0].text
        '15='
    """
    try:
        if spec in BUILTIN_TASKS:
            task = _make_builtin(spec, kwargs)
        elif ":" in spec:
            task = _make_from_factory(spec, kwargs)
        else:
            raise ValueError(f"unknown task {spec!r}; expected {_ALLOWED}")
    except TypeError as e:  # wrong keyword arguments: say which task they were meant for
        raise TypeError(f"task {spec!r} with arguments {kwargs}: {e}") from e
    if not isinstance(task, Task):
        missing = [m for m in TASK_MEMBERS if not hasattr(task, m)]
        raise TypeError(f"task spec {spec!r} returned {type(task).__name__}, which is not a "
                        f"Task: missing {missing}")
    for split in ("train_prompts", "val_prompts"):
        prompts = getattr(task, split)()
        if len(prompts) == 0:
            raise ValueError(f"task {spec!r} ({task.name}): {split}() is empty")
        if not isinstance(prompts[0], Prompt):
            raise TypeError(f"task {spec!r} ({task.name}): {split}() must hold Prompt objects, "
                            f"got {type(prompts[0]).__name__}")
    return task


MAX_ABS_REWARD = 1e6
"""The largest reward magnitude accepted. Rewards are float32 and GRPO/whitening square
them: 1e300 became inf and then NaN advantages, far from the reward that caused it."""


def check_reward(value: Any, *, task_name: str, prompt: Prompt) -> float:
    """`value` as a float; ValueError naming the task and prompt if it is not a number (a
    bool or a string is refused), not finite, or beyond +-`MAX_ABS_REWARD`.

    Example:
        >>> check_reward(1, task_name="t", prompt=Prompt(index=0, text="1=", answer="1"))
        1.0
    """
    where = f"task {task_name!r} returned reward {value!r} for prompt {prompt.index} " \
            f"({prompt.text!r})"
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
