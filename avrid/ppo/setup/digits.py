"""Chapter 5 — the built-in digit task: "381=" -> "183" (reverse, copy or sort the digits).

Small enough that a tiny randomly initialised model learns it on a CPU in minutes, yet its
reward is real (partial credit per correct digit), so the whole PPO/GRPO loop can be watched
working. Its prompts are every string of `length` digits, in a seeded order.

What this file is not: the task contract (`task.py`) or how tasks are found by name
(`catalog.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, overload

from avrid.ppo.setup.task import Prompt

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
        return Prompt(index=i, text=digits + "=", answer=DIGIT_OPS[self.op](digits),
                      metadata={"op": self.op})


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
